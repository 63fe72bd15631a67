"""Real runs on the shipped arithmetic data whose reward function records every reply it judges, so a test
can compare the text the task was given with the tokens the store holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import ROOT, run_sfhpc

RECORDING_REWARD = """\
import json, os

def reward(reply, answer):
    with open(os.environ["SFHPC_TEST_REPLIES"], "a", encoding="utf-8") as f:
        f.write(json.dumps(reply) + "\\n")
    return float(len(reply) % 3 == 0)  # some spread, so that training moves the weights
"""


def task_and_roles(reply_tokens: int) -> str:
    """The recipe's task (the recording reward on arith-word) and its two-node roles."""
    return f"""\
task:
  name: dataset
  options: {{path: {ROOT / 'data' / 'arith-word' / 'train.jsonl'}, prompt: question, answer: answer,
             reward: "recording.py:reward", max_reply_tokens: {reply_tokens}}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
"""


def run_recording_replies(tmp_path: Path, recipe_text: str,
                          env: dict[str, str] | None = None) -> tuple[Path, list[str]]:
    """Run the recipe with `sfhpc run` (`env` added to its environment); returns its run folder and the replies
    the task judged, in order."""
    (tmp_path / "recording.py").write_text(RECORDING_REWARD)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text + f"output_dir: {tmp_path / 'runs'}\n")
    replies_file = tmp_path / "replies.jsonl"
    done = run_sfhpc("run", str(recipe), env={"SFHPC_TEST_REPLIES": str(replies_file), **(env or {})}, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    return run_dir, [json.loads(line) for line in replies_file.read_text().splitlines()]
