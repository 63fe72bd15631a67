"""``seamless`` with real vLLM engines and an agent program, weight updates staged (mpiexec, real torch training,
the HDF5 store; the program imports nothing from sfhpc and calls the OpenAI API with the `openai` client).

Rank 1 trains and, tagged ``rollout``, holds a vLLM engine beside its trainer; rank 2 is a rollout rank. The
programs run on rank 2 (rebalancing: a lent rank plays no episodes of its own) and their episodes move by their
generations: while rank 1 is lent its engine takes half the replies rank 2's engine holds, each cut at a token
boundary and continued from its prefix there, and when rank 1 is taken back those it holds come home the same
way (the tests on the test engine pace it to make both happen). Rank 2's engine runs every reply it holds at once
(``max_num_seqs: 8``), so what the lent engine takes is mid-reply, not still queued. Weight versions reach the
engines over the torch transport into a second copy while they go on generating (``engine.staged_updates``), and
each engine switches at a token boundary. Each program writes down every reply it was handed; the store must hold
exactly that text as the tokens its segments recorded, over both engines and across versions, and no episode may
be played again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rl.moving_programs import MovedRun, program

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

PROGRAM = program(2, "64", "float(len(text) % 2)")

RECIPE = """\
name: programs-move-vllm
seed: 4
algorithm: {{group_size: 2}}
pipeline: {{mode: seamless, max_staleness: 2}}
engine: {{name: vllm, weight_transport: torch, staged_updates: true, max_num_seqs: 8}}
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
    run = MovedRun(tmp_path, RECIPE, PROGRAM, timeout=900)
    assert sum(e.get("routed", 0) for e in run.events if e["event"] in ("rebalanced", "reclaimed")) >= 1, run.events
    logs = "".join(log.read_text() for log in (run.run_dir / "logs").glob("rank-*.log"))
    assert "this rank's engine receives as members 1-1" in logs  # rank 2's vLLM worker takes the versions itself
    assert not [t.id for t in run.trajectories if t.status == "aborted"]  # no episode was played afresh
    crossed = {("vllm-r2", "vllm-r1"): 0, ("vllm-r1", "vllm-r2"): 0}
    across_versions = 0
    for t in run.trajectories:
        for reply_span, (reply, _) in zip(t.reply_spans(), t.replies()):
            generated = [t.segments[index] for index, _ in reply_span]
            for before, after in zip(generated, generated[1:]):
                if before.engine != after.engine:  # cut at a token boundary where it was, continued from the prefix
                    assert before.finish_reason == "abort", [(s.engine, s.finish_reason) for s in generated]
                    crossed[before.engine, after.engine] += 1
            versions = {int(v) for index, used in reply_span for v in t.segments[index].versions[:used]}
            across_versions += len(versions) > 1
            if t.status in ("consumed", "finished"):  # every reply of a played episode was handed to its program
                # The program was handed exactly the recorded tokens: what each engine made, under each version.
                assert run.handed(reply)
    # Rebalanced onto the lent engine mid-reply, continued there from the prefix rank 2's engine made. (Taken back
    # mid-reply, a reply comes home the same way; whether the lent engine is still generating when the batch is
    # ready depends on the machine's pace, so that direction is counted, not required.)
    assert crossed[("vllm-r2", "vllm-r1")] >= 1, crossed
    assert across_versions >= 1  # a reply the engine went on with after loading a staged version
