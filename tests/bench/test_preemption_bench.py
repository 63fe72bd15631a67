"""The preemption benchmark's own logic: the recipe it derives and the figures it computes from a run
folder (events, metrics, the checkpoint's manifest) and the store's trajectories before and after.

(Running it is `sfhpc bench preemption`: a real run cut by SIGTERM and resumed, minutes; the cut and the
resume themselves are tested in tests/rl/test_preemption_local.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from sfhpc.bench.preemption import Observed, at_cut, bench_recipe, stop_and_restart_times, token_fates
from sfhpc.cli import available_benchmarks
from sfhpc.config import load_recipe
from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory
from sfhpc.errors import SfhpcError
from tests.conftest import ROOT, assert_one_line_error, run_sfhpc

T0 = 1_700_000_000.0  # the signal


def test_the_demo_recipe_becomes_a_short_run_into_the_bench_folder(tmp_path: Path) -> None:
    demo = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    data = bench_recipe(demo, 9, tmp_path / "out")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(str(path))
    assert recipe.name == "demo-preemption" and recipe.budgets.steps == 9 and recipe.budgets.wall_minutes is None
    assert recipe.output_dir == str(tmp_path / "out") and recipe.pipeline.mode == "async"
    assert demo == yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())  # left as it was
    assert "preemption" in available_benchmarks()  # `sfhpc bench all` (and so `make bench`) runs it


def _folder(tmp_path: Path, *, discarded: int = 0) -> Path:
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step-000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "MANIFEST.json").write_text("{}")
    os.utime(checkpoint / "MANIFEST.json", (T0 + 1.5, T0 + 1.5))
    events = [
        {"event": "checkpoint", "time": T0 - 20, "restart": 0, "path": str(run / "checkpoints" / "step-000002"),
         "step": 2, "reason": "periodic", "seconds": 0.4},
        {"event": "stop-requested", "time": T0 + 0.25, "restart": 0, "rank": 2, "signal": "SIGTERM"},
        {"event": "quiesced", "time": T0 + 0.5, "restart": 0, "interrupted": 7},
        {"event": "checkpoint", "time": T0 + 1.6, "restart": 0, "path": str(checkpoint), "step": 4,
         "reason": "stop:SIGTERM", "seconds": 1.0},
        {"event": "stopped", "time": T0 + 1.7, "restart": 0, "signal": "SIGTERM", "step": 4},
        {"event": "resumed", "time": T0 + 40, "restart": 0, "step": 4, "version": 4, "seconds": 12.0,
         "resumed": 7, "replayed": 1, "dropped_stale": 8, "abandoned": 0, "finished": 3},
        {"event": "finished", "time": T0 + 60, "restart": 0, "step": 6},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rows = [{"step": s, "step_s": 2.0 if s == 5 else 1.0} for s in range(1, 7)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if discarded:
        (run / "metrics-discarded.jsonl").write_text("".join(json.dumps({"step": 5 + i}) + "\n"
                                                             for i in range(discarded)))
    return run


def test_stop_and_restart_times_come_from_the_events_the_manifest_and_what_the_bench_saw(tmp_path: Path) -> None:
    run = _folder(tmp_path)
    seen = Observed(signal_sent=T0, first_leg_exit=T0 + 5, resume_launched=T0 + 20,
                    first_new_step_seen=T0 + 42.1)
    got = stop_and_restart_times(run, seen)
    assert got["signal"] == "SIGTERM" and got["checkpoint_step"] == 4 and got["interrupted_at_stop"] == 7
    assert got["signal_to_stop_noticed_s"] == pytest.approx(0.25)
    assert got["signal_to_manifest_s"] == pytest.approx(1.5)  # the stop checkpoint's, not the periodic one's
    assert got["signal_to_checkpoint_s"] == pytest.approx(1.6) and got["checkpoint_write_s"] == 1.0
    assert got["signal_to_exit_s"] == pytest.approx(5.0)
    assert got["restart_to_first_new_step_s"] == pytest.approx(22.1)  # seen by the bench
    assert got["restart_to_first_new_step_from_events_s"] == pytest.approx(22.0)  # resumed + step 5's 2 s
    assert got["restart_startup_s"] == pytest.approx(8.0) and got["resume_engines_and_plan_s"] == 12.0
    assert got["first_new_step"] == 5 and got["steps_discarded"] == 0 and got["metrics_steps"] == [1, 2, 3, 4, 5, 6]
    assert got["resumed"] == {"resumed": 7, "replayed": 1, "dropped_stale": 8, "abandoned": 0, "finished": 3}
    unseen = stop_and_restart_times(_folder(tmp_path / "b", discarded=2),
                                    Observed(T0, T0 + 5, T0 + 20, None))
    assert unseen["restart_to_first_new_step_s"] == pytest.approx(22.0)  # from the events when not seen
    assert unseen["steps_discarded"] == 2


def test_a_folder_without_a_stop_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    run = _folder(tmp_path)
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines
                                              if e.get("reason") != "stop:SIGTERM"))
    with pytest.raises(SfhpcError, match="no stop checkpoint"):
        stop_and_restart_times(run, Observed(T0, T0 + 5, T0 + 20, None))


def _gen(parent: int, fork_at: int, n: int, t: float = T0) -> Segment:
    return Segment.of(SegmentKind.GENERATED, parent, fork_at, [7] * n, versions=3, t_start=t, t_end=t)


def _traj(tid: str, status: Status, *segments: Segment, updated: float = T0) -> Trajectory:
    prompt = Segment.of(SegmentKind.PROMPT, -1, 0, [1] * 10)
    return Trajectory(tid, (prompt, *segments), group="g", status=status, updated=updated)


def test_tokens_of_the_old_allocation_are_kept_stale_or_lost() -> None:
    resumed_at = T0 + 40
    before_list = [
        _traj("trained-before", Status.CONSUMED, _gen(0, 10, 5)),
        _traj("stale-before", Status.STALE, _gen(0, 10, 6)),
        _traj("continued", Status.INTERRUPTED, _gen(0, 10, 4)),
        _traj("waiting", Status.FINISHED, _gen(0, 10, 3)),
        _traj("stale-at-restart", Status.INTERRUPTED, _gen(0, 10, 8)),
        _traj("stale-later", Status.FINISHED, _gen(0, 10, 9)),
        _traj("aborted", Status.RUNNING, _gen(0, 10, 2)),
        _traj("forked", Status.INTERRUPTED, _gen(0, 10, 10)),
        _traj("still-open", Status.INTERRUPTED, _gen(0, 10, 1)),
        _traj("with-a-dead-branch", Status.FINISHED, _gen(0, 10, 4), _gen(0, 10, 5)),
    ]
    before = {t.id: at_cut(t) for t in before_list}
    assert before["with-a-dead-branch"].generated == 5 and before["with-a-dead-branch"].generated_all == 9
    after = [
        _traj("trained-before", Status.CONSUMED, _gen(0, 10, 5)),
        _traj("stale-before", Status.STALE, _gen(0, 10, 6)),
        _traj("continued", Status.CONSUMED, _gen(0, 10, 4), _gen(1, 4, 6)),  # went on from its prefix
        _traj("waiting", Status.FINISHED, _gen(0, 10, 3)),
        _traj("stale-at-restart", Status.STALE, _gen(0, 10, 8), updated=resumed_at - 1),
        _traj("stale-later", Status.STALE, _gen(0, 10, 9), updated=resumed_at + 30),
        _traj("aborted", Status.ABORTED, _gen(0, 10, 2)),
        _traj("forked", Status.CONSUMED, _gen(0, 10, 10), _gen(1, 7, 3)),  # 3 of its 10 tokens left the branch
        _traj("still-open", Status.INTERRUPTED, _gen(0, 10, 1)),
        _traj("with-a-dead-branch", Status.CONSUMED, _gen(0, 10, 4), _gen(0, 10, 5)),
    ]
    got = token_fates(before, after, resumed_at)
    tokens, counts = got["tokens"], got["trajectories"]
    assert tokens["generated_before_cut"] == 5 + 6 + 4 + 3 + 8 + 9 + 2 + 10 + 1 + 9
    assert (tokens["consumed_before"], tokens["dropped_before"], tokens["off_branch_before"]) == (5, 6, 4)
    assert tokens["in_flight"] == 4 + 3 + 8 + 9 + 2 + 10 + 1 + 5
    assert tokens["kept"] == 4 + 3 + 7 + 5 and tokens["off_branch"] == 3
    assert (tokens["stale_at_restart"], tokens["stale_later"], tokens["stale"]) == (8, 9, 17)
    assert tokens["aborted"] == 2 and tokens["open_at_end"] == 1 and tokens["lost"] == 2 + 3
    # Every token of the old allocation is in exactly one place.
    places = ("consumed_before", "dropped_before", "off_branch_before", "kept", "stale", "open_at_end", "lost")
    assert sum(tokens[k] for k in places) == tokens["generated_before_cut"]
    assert counts == {"in_flight": 8, "continued": 2, "consumed": 3, "finished": 1, "stale_at_restart": 1,
                      "stale_later": 1, "aborted": 1, "failed": 0, "missing": 0, "open_at_end": 1}
    missing = token_fates(before, [t for t in after if t.id != "waiting"], resumed_at)
    assert missing["tokens"]["missing"] == 3 and missing["tokens"]["lost"] == 2 + 3 + 3


def test_bad_options_get_one_line() -> None:
    assert_one_line_error(run_sfhpc("bench", "preemption", "--steps", "4", "--cut-after", "3"), "--cut-after")
    assert_one_line_error(run_sfhpc("bench", "preemption", "--recipe", "nope.yaml"), "nope.yaml")
