"""``seamless`` with real vLLM engines (mpiexec, real torch training, the HDF5 store), once and short.

Rank 1 is the trainer and, its node tagged ``rollout``, also holds a vLLM engine in CPU memory beside its
trainer; rank 2 is a rollout rank. An untrained policy writes long replies (it rarely draws its end-of-turn
token), so when a batch is ready the lent trainer's engine is mid-reply: those replies are cut there and
finish on rank 2's engine from their prefix, in one reply the task judged as it is stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from tests.rl.recorded_replies import run_recording_replies, task_and_roles

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

STEPS = 6  # a reply moved in one step may be cut again by the next weight updates before it finishes
REPLY_TOKENS = 64
RECIPE = f"""\
name: lend-vllm
seed: 4
algorithm: {{group_size: 2}}
pipeline: {{mode: seamless, max_staleness: 2}}
budgets: {{steps: {STEPS}, prompts_per_step: 2, max_new_tokens: {REPLY_TOKENS}}}
""" + task_and_roles(REPLY_TOKENS)


def test_a_lent_vllm_engine_is_reclaimed_and_its_replies_finish_on_the_rollout_engine(tmp_path: Path) -> None:
    run_dir, judged = run_recording_replies(tmp_path, RECIPE)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    reclaims = [e for e in events if e["event"] == "reclaimed"]
    assert [e["step"] for e in reclaims] == list(range(1, STEPS + 1)), reclaims
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reclaim_s"] < 1.0 for r in rows), [r["reclaim_s"] for r in rows]
    assert sum(e["continued"] for e in reclaims) >= 1, reclaims

    tokenizer = load_tokenizer(run_dir / "model")
    stops = set(tokenizer.chat_stop_ids)
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    moved = 0
    for t in trajectories:
        generated = [s for s in t.segments if s.generated]
        if t.status in ("consumed", "finished", "stale"):  # finished generating: one whole reply
            (reply, cut), = t.replies()
            assert not cut and sum(len(s) for s in generated) == len(reply)  # no generated token discarded
            text = tokenizer.decode([int(x) for x in reply if int(x) not in stops])
            assert text in judged  # the task judged exactly the stored prefix + continuation
            if {s.engine for s in generated} == {"vllm-r1", "vllm-r2"}:
                moved += 1
                assert generated[0].engine == "vllm-r1" and generated[0].finish_reason == "abort"
                assert generated[-1].engine == "vllm-r2"
    assert moved >= 1, "no reply was cut on the lent trainer's engine and finished on the rollout engine"
