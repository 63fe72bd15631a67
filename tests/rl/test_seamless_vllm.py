"""``seamless`` with real vLLM engines (mpiexec, real torch training, the HDF5 store), once and short.

Rank 1 is the trainer and, its node tagged ``rollout``, also holds a vLLM engine in CPU memory beside its
trainer; rank 2 is a rollout rank. An untrained policy writes long replies (it rarely draws its end-of-turn
token). Each engine holds two sequences at a time (``max_num_seqs: 2``), so each works through a queue of
episodes oldest first. New episodes go to the rollout engine only; the lent engine, dry, takes half the replies
the rollout engine holds (rebalancing): those it had begun go on from their prefix on the lent engine, those
still queued begin there (which of the two depends on how far rank 2's engine got when the lend came: at the
first step it may not have sampled a token yet). When the batch is ready the lent engine is mid-reply with a
queue left, and those replies are cut there and finish on rank 2's engine from their prefix, in one reply the
task judged as it is stored.
(With vLLM's default every queued reply runs at once: the lent engine could finish all it held in the same
decode step that made the batch ready, leaving nothing to cut.)

The weights travel over the torch transport (``engine.weight_transport: torch``; gloo here): the rollout
engine's vLLM worker joins the group and receives every version itself.
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
engine: {{name: vllm, weight_transport: torch, max_num_seqs: 2}}
budgets: {{steps: {STEPS}, prompts_per_step: 2, max_new_tokens: {REPLY_TOKENS}}}
""" + task_and_roles(REPLY_TOKENS)


def test_a_lent_vllm_engine_is_reclaimed_and_its_replies_finish_on_the_rollout_engine(tmp_path: Path) -> None:
    run_dir, judged = run_recording_replies(tmp_path, RECIPE)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    reclaims = [e for e in events if e["event"] == "reclaimed"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lent_steps = [r["step"] for r, before in zip(rows, [0] + [r["lends"] for r in rows]) if r["lends"] > before]
    assert lent_steps[:1] == [1] and [e["step"] for e in reclaims] == lent_steps, reclaims
    assert all(r["reclaim_s"] < 5.0 for r in rows), [r["reclaim_s"] for r in rows]  # a cut, not a wait
    # Every version reached the rollout engine's worker over the torch group.
    logs = "".join(log.read_text() for log in (run_dir / "logs").glob("rank-*.log"))
    assert "weights travel over torch.distributed (gloo), 2 members; this rank sends as member 0" in logs
    assert "this rank's engine receives as members 1-1" in logs
    assert sum(e["continued"] for e in reclaims) >= 1, reclaims

    tokenizer = load_tokenizer(run_dir / "model")
    stops = set(tokenizer.chat_stop_ids)
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    moves: dict[tuple[str, str], int] = {}
    begun_on_lent = 0  # rebalanced before rank 2's engine sampled a token of them: the lent engine gets no new ones
    for t in trajectories:
        generated = [s for s in t.segments if s.generated]
        begun_on_lent += bool(generated) and generated[0].engine == "vllm-r1"
        if t.status in ("consumed", "finished", "stale"):  # finished generating: one whole reply
            (reply, cut), = t.replies()
            assert not cut and sum(len(s) for s in generated) == len(reply)  # no generated token discarded
            text = tokenizer.decode([int(x) for x in reply if int(x) not in stops])
            assert text in judged  # the task judged exactly the stored prefix + continuation
        # Moves are counted on every trajectory: one moved late in the run may still be generating when the
        # run ends (how late depends on the machine's speed), its segments recorded all the same.
        for before, after in zip(generated, generated[1:]):
            if before.engine != after.engine:  # cut mid-reply where it was, continued from the prefix
                assert before.finish_reason == "abort" and len(before) > 0
                moves[before.engine, after.engine] = moves.get((before.engine, after.engine), 0) + 1
    # Reclaimed: cut on the lent trainer's engine, finished on the rollout engine.
    assert moves.get(("vllm-r1", "vllm-r2"), 0) >= 1, moves
    # Rebalanced: the lent engine ran dry while the trainer waited and took replies the rollout engine held,
    # continuing from their prefix those rank 2 had begun (asserted above for every move).
    assert moves.get(("vllm-r2", "vllm-r1"), 0) + begun_on_lent >= 1, (moves, begun_on_lent)
    rebalanced = [e for e in events if e["event"] == "rebalanced"]
    assert rebalanced and sum(r["rebalanced"] for r in rows) == sum(e["moved"] for e in rebalanced), rebalanced
    assert all(e["drained"] == [1] and e["donors"] == {"2": e["moved"]} for e in rebalanced), rebalanced
