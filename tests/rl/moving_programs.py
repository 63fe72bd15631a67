"""Runs of `seamless` with an agent program that records every reply it is handed, for the tests of programs'
episodes moving by their generations: the program (it imports nothing from sfhpc and calls the OpenAI API with the
`openai` client), the run, and what a test compares (the replies the program was handed, the stored
trajectories)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from tests.conftest import run_sfhpc


def program(turns: int, max_tokens: str, reward: str) -> str:
    """A program of `turns` calls per episode, each asking for `max_tokens` (an expression of `episode`) and
    appending the reply it got to the file its first argument names; `reward` is an expression of `text`, the
    last reply."""
    return f"""\
import json, random, sys
import openai

replies = sys.argv[1]
for line in sys.stdin:
    episode = json.loads(line)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
    messages = episode["messages"]
    for turn in range({turns}):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens={max_tokens})
        text = reply.choices[0].message.content
        with open(replies, "a", encoding="utf-8") as f:
            f.write(json.dumps(text) + "\\n")
        messages = messages + [{{"role": "assistant", "content": text}}, {{"role": "user", "content": "again"}}]
    print(json.dumps({{"episode_id": episode["episode_id"], "reward": {reward}}}), flush=True)
"""


class MovedRun:
    """A finished run of `recipe` (its text, with ``{python}``, ``{program}``, ``{replies}`` and ``{runs}`` to
    fill in) whose agent is `program_text`."""

    def __init__(self, tmp_path: Path, recipe: str, program_text: str, timeout: float, **fields: Any) -> None:
        (tmp_path / "program.py").write_text(program_text)
        replies_file = tmp_path / "replies.jsonl"
        path = tmp_path / "recipe.yaml"
        path.write_text(recipe.format(python=sys.executable, program=tmp_path / "program.py", replies=replies_file,
                                      runs=tmp_path / "runs", **fields))
        done = run_sfhpc("run", str(path), timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        self.run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
        self.events = [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]
        self.rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
        self.judged = [json.loads(line) for line in replies_file.read_text().splitlines()]
        self.tokenizer = load_tokenizer(self.run_dir / "model")
        self._stops = set(self.tokenizer.chat_stop_ids)
        with open_store(self.run_dir / "trajectories.h5") as store:
            self.trajectories = list(store.trajectories())

    def handed(self, reply: Iterable[int]) -> bool:
        """Whether the program was handed exactly these tokens as one reply (their text, stop tokens left out)."""
        return self.tokenizer.decode([int(x) for x in reply if int(x) not in self._stops]) in self.judged
