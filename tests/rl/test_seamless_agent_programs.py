"""``seamless`` with an agent program (real MPI ranks, real training and store, the deterministic test engine; the
program imports nothing from sfhpc and calls the OpenAI API with the `openai` client).

Rank 1 trains and is lent to rollout while the trainer waits; rank 2 is a rollout rank. An agent program's
episode cannot move (its state is the program's, its connection its rank's endpoint), so its generation moves
instead: at a reclaim, the programs on rank 1 keep playing there while their replies, cut at a token boundary,
go on on rank 2's engine, and so do their later turns. The stored replies must show it (segments of two
engines, cut where the engine changed, the program handed exactly the recorded prefix + continuation); no
episode is replayed (nothing aborted), and the scheduler's count of episodes in flight stays true while ends
are reported from the program's rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rl.moving_programs import MovedRun, program

pytestmark = [pytest.mark.mpi]

PROGRAM = program(3, 'random.Random(episode["problem"]["key"]).randint(10, 70)', "1.0")  # uneven replies

RECIPE = """\
name: programs-move
seed: 5
engine: {{name: test, token_delay_s: 0.02, writes_to_budget: true}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 2}}
pipeline: {{mode: seamless, max_staleness: 3, rebalance: {rebalance}}}
budgets: {{steps: 5, prompts_per_step: 2, max_new_tokens: 70}}
task: {{name: repeat-letter, options: {{min_count: 60, max_count: 70}}}}
agent: {{command: [{python}, {program}, {replies}], workers: 8, timeout_s: 120}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
output_dir: {runs}
"""


@pytest.mark.parametrize("rebalance", [False, True])
def test_agent_programs_episodes_move_by_their_generations_and_none_is_replayed(tmp_path: Path,
                                                                                rebalance: bool) -> None:
    """Without rebalancing the lent rank plays new episodes, and at the reclaim its programs keep playing on it while
    it trains, their generations routed to rank 2. With rebalancing (the default) it plays none of its own: while
    lent it generates for rank 2's programs, in every lend, and hands them back when it is taken back."""
    run = MovedRun(tmp_path, RECIPE, PROGRAM, timeout=600, rebalance=str(rebalance).lower())
    events, rows = run.events, run.rows
    assert len(rows) == 5

    moves = [e for e in events if e["event"] == ("rebalanced" if rebalance else "reclaimed")]
    assert sum(e["routed"] for e in moves) >= 1, moves  # programs' generations, moved
    reclaims = [e["time"] for e in events if e["event"] == "reclaimed"]
    # Every episode an end counted where the scheduler counted it in flight: never below zero, never more than
    # the groups in flight hold.
    assert all(0 <= r["episodes_in_flight"] <= 2 * r["groups_in_flight"] for r in rows), rows

    trajectories = run.trajectories
    assert not [t.id for t in trajectories if t.status == "aborted"]  # no episode was played afresh
    crossed, lends = 0, set()
    for t in trajectories:
        if t.status not in ("consumed", "finished"):
            continue
        lengths = {len(reply) for reply, cut in t.replies() if not cut}
        assert len(t.replies()) == 3 and len(lengths) == 1 and 10 <= lengths.pop() <= 70
        for reply_span, (reply, _) in zip(t.reply_spans(), t.replies()):
            generated = [t.segments[index] for index, _ in reply_span]
            for before, after in zip(generated, generated[1:]):
                if before.engine != after.engine:  # cut at a token boundary where it was, continued from the prefix
                    assert before.finish_reason == "abort", [(s.engine, s.finish_reason) for s in generated]
            # Cut on the lent rank's engine at the reclaim, continued on rank 2's while the program stayed on rank 1
            # (an episode played afresh instead would leave its trajectory aborted); rebalanced, cut on rank 2's
            # and continued on the lent rank's.
            order = ("test-r2", "test-r1") if rebalance else ("test-r1", "test-r2")
            crossed += any((a.engine, b.engine) == order for a, b in zip(generated, generated[1:]))
            # Which lend (the reclaims before it) each of the lent rank's segments was generated in.
            lends |= {sum(r < s.t_start for r in reclaims) for s in generated if s.engine == "test-r1"}
            # The program was handed the whole reply: what one engine made and the rest the other made.
            assert run.handed(reply)
    assert crossed >= 1, f"no program's reply was cut on {order[0]}'s engine and finished on {order[1]}'s"
    if rebalance:  # lent again after a reclaim, it takes generations again
        assert len(lends) >= 2, lends
