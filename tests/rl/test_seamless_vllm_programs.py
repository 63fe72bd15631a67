"""``seamless`` with real vLLM engines and an agent program, weight updates staged (mpiexec, real torch training,
the HDF5 store; the program imports nothing from sfhpc and calls the OpenAI API with the `openai` client).

Rank 1 trains and, tagged ``rollout``, holds a vLLM engine beside its trainer; rank 2 is a rollout rank. The
programs run on rank 2 (rebalancing: a lent rank plays no episodes of its own) and their episodes move by their
generations: while rank 1 is lent its engine takes half the replies rank 2's engine holds, each cut at a token
boundary and continued from its prefix there, and when rank 1 is taken back those it holds come home the same
way (the tests on the test engine pace it to make both happen). Weight versions reach the engines over the torch
transport into a second copy while they go on generating (``engine.staged_updates``), and each engine switches
at a token boundary. Each program writes down every reply it was handed; the store must hold exactly that text
as the tokens its segments recorded, over both engines and across versions, and no episode may be played again.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

PROGRAM = """\
import json, sys
import openai

replies = sys.argv[1]
for line in sys.stdin:
    episode = json.loads(line)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
    messages = episode["messages"]
    for turn in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=64)
        text = reply.choices[0].message.content
        with open(replies, "a", encoding="utf-8") as f:
            f.write(json.dumps(text) + "\\n")
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    print(json.dumps({"episode_id": episode["episode_id"], "reward": float(len(text) % 2)}), flush=True)
"""

RECIPE = """\
name: programs-move-vllm
seed: 4
algorithm: {{group_size: 2}}
pipeline: {{mode: seamless, max_staleness: 2}}
engine: {{name: vllm, weight_transport: torch, staged_updates: true, max_num_seqs: 2}}
budgets: {{steps: 6, prompts_per_step: 2, max_new_tokens: 64}}
task: {{name: repeat-letter, options: {{min_count: 56, max_count: 62}}}}
agent: {{command: [{python}, {program}, {replies}], workers: 8, timeout_s: 300}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
output_dir: {runs}
"""


def test_agent_programs_generations_move_between_vllm_engines_across_staged_updates(tmp_path: Path) -> None:
    (tmp_path / "program.py").write_text(PROGRAM)
    replies_file = tmp_path / "replies.jsonl"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(python=sys.executable, program=tmp_path / "program.py", replies=replies_file,
                                    runs=tmp_path / "runs"))
    done = run_sfhpc("run", str(recipe), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e.get("routed", 0) for e in events if e["event"] in ("rebalanced", "reclaimed")) >= 1, events
    logs = "".join(log.read_text() for log in (run_dir / "logs").glob("rank-*.log"))
    assert "this rank's engine receives as members 1-1" in logs  # rank 2's vLLM worker takes the versions itself

    judged = [json.loads(line) for line in replies_file.read_text().splitlines()]
    tokenizer = load_tokenizer(run_dir / "model")
    stops = set(tokenizer.chat_stop_ids)
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    assert not [t.id for t in trajectories if t.status == "aborted"]  # no episode was played afresh
    crossed = {("vllm-r2", "vllm-r1"): 0, ("vllm-r1", "vllm-r2"): 0}
    across_versions = 0
    for t in trajectories:
        for reply_span in t.reply_spans():
            generated = [t.segments[index] for index, _ in reply_span]
            for before, after in zip(generated, generated[1:]):
                if before.engine != after.engine:  # cut at a token boundary where it was, continued from the prefix
                    assert before.finish_reason == "abort", [(s.engine, s.finish_reason) for s in generated]
                    crossed[before.engine, after.engine] += 1
            reply = [int(x) for index, used in reply_span for x in t.segments[index].tokens[:used]]
            versions = {int(v) for index, used in reply_span for v in t.segments[index].versions[:used]}
            across_versions += len(versions) > 1
            if t.status in ("consumed", "finished"):  # every reply of a played episode was handed to its program
                # The program was handed exactly the recorded tokens: what each engine made, under each version.
                assert tokenizer.decode([x for x in reply if x not in stops]) in judged
    # Rebalanced onto the lent engine mid-reply, continued there from the prefix rank 2's engine made. (Taken back
    # mid-reply, a reply comes home the same way; whether the lent engine is still generating when the batch is
    # ready depends on the machine's pace, so that direction is counted, not required.)
    assert crossed[("vllm-r2", "vllm-r1")] >= 1, crossed
    assert across_versions >= 1  # a reply the engine went on with after loading a staged version
