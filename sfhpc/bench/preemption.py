"""Benchmark: what a preemption costs: time to a safe checkpoint, time back to training, tokens lost.

    python -m sfhpc.bench.preemption [--recipe recipes/demo.yaml] [--steps 12] [--cut-after 4]

Runs the recipe on this machine (``sfhpc run``: mpiexec, real vLLM engines, real training) for a short
step budget, sends SIGTERM to every rank process and everything it started once ``--cut-after`` steps are
done (what Slurm does to a step's processes on a preemption or ``scontrol requeue``), waits for the run to
stop at its safe point (exit 75), then resumes it (``sfhpc run RECIPE --resume RUN_DIR``) to the end. It reports:

* *stop*: signal sent -> the controller noticed it (``stop-requested`` event) -> the checkpoint complete
  on disk (its ``MANIFEST.json``, written last, then the folder renamed into place: the ``checkpoint``
  event) -> the run's processes gone (the allocation could be handed back);
* *restart*: launching the ``--resume`` process -> the first metrics row of a step after the checkpoint,
  split into start-up (processes, MPI, model and checkpoint load), the controller's resume (the
  ``resumed`` event's seconds: waiting for the engines to come up and take the checkpoint's weights, the
  resume plan) and that first step;
* *tokens*: the policy-generated tokens in the store when the old allocation stopped, and what became
  of them after the restart. Those of trajectories in flight then (running, interrupted, or finished and
  not yet trained on) are *kept* when they are still on the trajectory's branch at the end and it
  finished or was trained on; *stale* when the trajectory was dropped as too stale (at the restart, or
  later by the staleness bound: the design's price); *lost* otherwise (aborted, failed, cut off the
  branch): the figure to keep at 0. Steps trained after the checkpoint and thrown away at the restart
  (``metrics-discarded.jsonl``; 0 with a stop checkpoint) are counted too.

Results: ``runs/bench/preemption.json``; the run's folder is under ``runs/bench/preemption/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from sfhpc.bench import read_recipe_mapping, run_as_script
from sfhpc.bench._processes import rank_pids, step_pids
from sfhpc.data.run_log import read_log
from sfhpc.data.trajectory import Status, Trajectory
from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths
from sfhpc.table import format_table

STOPPED_EXIT = 75  # `sfhpc run`: stopped at a safe point, resumable (sfhpc.cli.STOPPED_EXIT)
RUN_TIMEOUT_S = 1200.0  # a whole leg (start-up included) on a small, busy machine
POLL_S = 0.05  # how often metrics.jsonl is looked at: the resolution of the restart figure


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sfhpc.bench.preemption", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, default=Path("recipes/demo.yaml"))
    p.add_argument("--steps", type=int, default=12, help="training steps of the run, both legs together")
    p.add_argument("--cut-after", type=int, default=4, help="send SIGTERM once this many steps are done")
    p.add_argument("--out", type=Path, default=Path("runs/bench/preemption.json"), help="JSON result file")
    args = p.parse_args(argv)
    if args.cut_after < 1 or args.steps < args.cut_after + 2:
        # At least one step after the stop checkpoint, and one more in case the stop lands a step late.
        raise SfhpcError("--cut-after must be at least 1 and --steps at least --cut-after + 2 "
                         f"(got --steps {args.steps}, --cut-after {args.cut_after})")
    return args


def bench_recipe(base: dict[str, Any], steps: int, output_dir: Path) -> dict[str, Any]:
    """The base recipe (as loaded from YAML) for a short budget, run into `output_dir`."""
    recipe = json.loads(json.dumps(base))  # a deep copy of plain YAML data
    recipe["name"] = f"{base.get('name', 'recipe')}-preemption"
    recipe["output_dir"] = str(output_dir)
    budgets = recipe.setdefault("budgets", {})
    budgets["steps"] = steps
    budgets.pop("wall_minutes", None)  # a wall budget would end the resumed leg early, not the steps
    return recipe


# -- what the store held at the cut, and what became of it ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AtCut:
    """One trajectory as the old allocation left it."""

    status: str
    segments: int  # segments recorded then (segments are append-only: these indices stay the same)
    generated: int  # policy-generated tokens on its branch then
    generated_all: int  # every policy-generated token recorded for it, all branches


def at_cut(trajectory: Trajectory) -> AtCut:
    on_branch = sum(used for i, used in trajectory.branch() if trajectory.segments[i].generated)
    return AtCut(str(trajectory.status), len(trajectory.segments), on_branch,
                 sum(len(s) for s in trajectory.segments if s.generated))


def kept_of(trajectory: Trajectory, old_segments: int) -> int:
    """Generated tokens of the first `old_segments` segments that are on the trajectory's branch now."""
    return sum(used for i, used in trajectory.branch() if i < old_segments and trajectory.segments[i].generated)


IN_FLIGHT = (Status.RUNNING, Status.INTERRUPTED, Status.FINISHED)  # at the cut: what a restart can lose
DROPPED = (Status.STALE, Status.ABORTED, Status.FAILED)


def token_fates(before: Mapping[str, AtCut], after: Iterable[Trajectory], resumed_at: float) -> dict[str, Any]:
    """Where the generated tokens of the old allocation went. `after`: the same trajectories at the end
    (a missing one counts as lost); `resumed_at`: the ``resumed`` event's time (drops up to then were
    the restart's)."""
    final = {t.id: t for t in after}
    tokens = dict.fromkeys(("consumed_before", "dropped_before", "off_branch_before", "in_flight", "kept",
                            "stale_at_restart", "stale_later", "aborted", "failed", "off_branch", "missing",
                            "open_at_end"), 0)
    counts = dict.fromkeys(("in_flight", "continued", "consumed", "finished", "stale_at_restart", "stale_later",
                            "aborted", "failed", "missing", "open_at_end"), 0)
    for trajectory_id, cut in before.items():
        status = Status(cut.status)
        tokens["off_branch_before"] += cut.generated_all - cut.generated
        if status is Status.CONSUMED:
            tokens["consumed_before"] += cut.generated
            continue
        if status in DROPPED:
            tokens["dropped_before"] += cut.generated
            continue
        tokens["in_flight"] += cut.generated
        counts["in_flight"] += 1
        end = final.get(trajectory_id)
        if end is None:
            tokens["missing"] += cut.generated
            counts["missing"] += 1
            continue
        if any(s.generated for s in end.segments[cut.segments:]):
            counts["continued"] += 1  # it generated again on the new allocation
        if end.status in (Status.CONSUMED, Status.FINISHED):
            kept = kept_of(end, cut.segments)
            tokens["kept"] += kept
            tokens["off_branch"] += cut.generated - kept
            counts[str(end.status)] += 1
        elif end.status is Status.STALE:
            fate = "stale_at_restart" if end.updated <= resumed_at else "stale_later"
            tokens[fate] += cut.generated
            counts[fate] += 1
        elif end.status in (Status.ABORTED, Status.FAILED):
            tokens[str(end.status)] += cut.generated
            counts[str(end.status)] += 1
        else:  # still open when the resumed run ended its budget: neither kept nor lost yet
            tokens["open_at_end"] += cut.generated
            counts["open_at_end"] += 1
    tokens["generated_before_cut"] = sum(c.generated_all for c in before.values())
    tokens["stale"] = tokens["stale_at_restart"] + tokens["stale_later"]
    tokens["lost"] = tokens["aborted"] + tokens["failed"] + tokens["off_branch"] + tokens["missing"]
    return {"tokens": tokens, "trajectories": counts}


# -- times, from the run folder and what the benchmark saw --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Observed:
    """Wall-clock times (time.time()) the benchmark itself saw."""

    signal_sent: float
    first_leg_exit: float
    resume_launched: float
    first_new_step_seen: float | None  # the first metrics row of a step after the checkpoint appeared


def _first(events: list[dict[str, Any]], name: str, after: float = 0.0, **match: Any) -> dict[str, Any]:
    for event in events:
        if event["event"] == name and event["time"] >= after and all(event.get(k) == v for k, v in match.items()):
            return event
    raise SfhpcError(f"the run's events.jsonl has no {name!r} event{' ' + str(match) if match else ''}")


def stop_and_restart_times(run_dir: Path, seen: Observed) -> dict[str, Any]:
    """The stop and restart figures of a cut and resumed run (see the module's docstring)."""
    events = read_log(RunPaths(run_dir).events)
    requested = _first(events, "stop-requested", restart=0)
    checkpoint = next((e for e in events if e["event"] == "checkpoint" and e["time"] >= requested["time"]
                       and str(e.get("reason", "")).startswith("stop:")), None)
    if checkpoint is None:
        raise SfhpcError(f"{run_dir}: no stop checkpoint after the stop request (events.jsonl)")
    manifest = Path(checkpoint["path"]) / "MANIFEST.json"
    manifest_at = manifest.stat().st_mtime if manifest.exists() else checkpoint["time"]
    resumed = _first(events, "resumed", after=checkpoint["time"])
    rows = read_log(RunPaths(run_dir).metrics)
    first_new = next((r for r in rows if r["step"] > resumed["step"]), None)
    if first_new is None:
        raise SfhpcError(f"{run_dir}: no step after the checkpoint's step {resumed['step']} in metrics.jsonl")
    # The first step after the restart starts right after the `resumed` event (run_loop): its end is that
    # event's time plus its step_s; the benchmark's own sighting of the row is used when it has one.
    derived = resumed["time"] + first_new["step_s"]
    first_new_at = seen.first_new_step_seen if seen.first_new_step_seen is not None else derived
    resume_work_from = resumed["time"] - resumed["seconds"]
    return {
        "signal": requested["signal"], "checkpoint": checkpoint["path"], "checkpoint_step": checkpoint["step"],
        "resumed_time": resumed["time"], "interrupted_at_stop": next(
            (e.get("interrupted") for e in events if e["event"] == "quiesced" and e["time"] >= requested["time"]),
            None),
        "signal_to_stop_noticed_s": requested["time"] - seen.signal_sent,
        "signal_to_manifest_s": manifest_at - seen.signal_sent,
        "signal_to_checkpoint_s": checkpoint["time"] - seen.signal_sent,
        "checkpoint_write_s": checkpoint.get("seconds"),
        "signal_to_exit_s": seen.first_leg_exit - seen.signal_sent,
        "restart_to_first_new_step_s": first_new_at - seen.resume_launched,
        "restart_to_first_new_step_from_events_s": derived - seen.resume_launched,
        "restart_startup_s": resume_work_from - seen.resume_launched,
        "resume_engines_and_plan_s": resumed["seconds"],
        "first_new_step_s": first_new["step_s"], "first_new_step": first_new["step"],
        "resumed": {k: resumed.get(k) for k in ("resumed", "replayed", "dropped_stale", "abandoned", "finished")},
        "steps_discarded": len(read_log(RunPaths(run_dir).metrics_discarded)),
        "metrics_steps": [r["step"] for r in rows],
    }


# -- running it -------------------------------------------------------------------------------------------


def _sfhpc(*args: str) -> subprocess.Popen[bytes]:
    """``sfhpc ARGS`` as a user would start it (its output goes to this terminal: the progress lines)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    return subprocess.Popen([sys.executable, "-m", "sfhpc", *args], env=env)


def _abandon(process: subprocess.Popen[bytes], run_dir: Path | None) -> None:
    """End a leg that went wrong: its ranks first (killing `sfhpc run` alone would leave mpiexec and the
    ranks running), then the command itself."""
    for pid in rank_pids(run_dir) if run_dir is not None else []:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    process.kill()
    process.wait()


def _wait(process: subprocess.Popen[bytes], run_dir: Path, what: str) -> int:
    try:
        return process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _abandon(process, run_dir)
        raise SfhpcError(f"{what} did not end within {RUN_TIMEOUT_S:.0f} s") from None


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    # The run is writing: a row half written is left out quietly and read next time.
    return read_log(RunPaths(run_dir).metrics, warn=lambda line: None)


def cut_and_resume(recipe_path: Path, output_dir: Path, cut_after: int) -> tuple[Path, Observed, dict[str, AtCut]]:
    """Run, SIGTERM every rank after `cut_after` steps, snapshot the store, resume to the end."""
    from sfhpc.data.store import open_store

    existing = set(output_dir.iterdir()) if output_dir.exists() else set()
    first = _sfhpc("run", str(recipe_path))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    run_dir: Path | None = None
    while first.poll() is None and time.monotonic() < deadline:
        if run_dir is None:
            new = sorted(p for p in output_dir.glob("*") if p.is_dir() and p not in existing) \
                if output_dir.exists() else []
            run_dir = new[0] if new else None
        if run_dir is not None and len(_rows(run_dir)) >= cut_after:
            break
        time.sleep(POLL_S)
    if run_dir is None or first.poll() is not None:
        _abandon(first, run_dir)
        raise SfhpcError(f"the run ended (or timed out) before {cut_after} steps were done; see its output above")
    pids = step_pids(run_dir)
    if not pids:
        _abandon(first, run_dir)
        raise SfhpcError(f"no rank process of {run_dir} found in /proc to send SIGTERM to")
    print(f"== sending SIGTERM to the {len(pids)} processes of the ranks (vLLM's included) after step "
          f"{len(_rows(run_dir))}", flush=True)
    signal_sent = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a helper process that ended meanwhile
            os.kill(pid, signal.SIGTERM)
    code = _wait(first, run_dir, "the cut run")
    first_leg_exit = time.time()
    if code != STOPPED_EXIT:
        raise SfhpcError(f"the cut run exited with {code}, not {STOPPED_EXIT} (stopped at a safe point); "
                         f"its logs are in {run_dir / 'logs'}")
    with open_store(RunPaths(run_dir).store) as store:
        before = {t.id: at_cut(t) for t in store.trajectories()}
    checkpoint_step = max(r["step"] for r in _rows(run_dir))
    print(f"== resuming {run_dir.name} from step {checkpoint_step}", flush=True)
    resume_launched = time.time()
    second = _sfhpc("run", str(recipe_path), "--resume", str(run_dir))
    first_new_seen = None
    while second.poll() is None and first_new_seen is None:
        if any(r["step"] > checkpoint_step for r in _rows(run_dir)):
            first_new_seen = time.time()
        time.sleep(POLL_S)
    code = _wait(second, run_dir, "the resumed run")
    if code != 0:
        raise SfhpcError(f"the resumed run exited with {code}; its logs are in {run_dir / 'logs'}")
    return run_dir, Observed(signal_sent, first_leg_exit, resume_launched, first_new_seen), before


def measure(run_dir: Path, seen: Observed, before: Mapping[str, AtCut]) -> dict[str, Any]:
    """Every figure of a cut and resumed run, from its folder and what the benchmark saw."""
    from sfhpc.data.store import open_store

    times = stop_and_restart_times(run_dir, seen)
    with open_store(RunPaths(run_dir).store) as store:
        after = [store.get(tid) for tid in before if tid in store]
    return {**times, **token_fates(before, after, times["resumed_time"])}


def report(result: dict[str, Any]) -> str:
    t, n = result["tokens"], result["trajectories"]

    def s(key: str, digits: int = 2) -> str:
        return f"{result[key]:.{digits}f} s"

    rows = [
        ("stop", "signal -> stop noticed", s("signal_to_stop_noticed_s", 3)),
        ("", "signal -> checkpoint on disk (manifest)", s("signal_to_manifest_s")),
        ("", "signal -> checkpoint complete (event)", s("signal_to_checkpoint_s")),
        ("", "  of which writing the checkpoint", f"{result['checkpoint_write_s']:.2f} s"),
        ("", "signal -> processes gone", s("signal_to_exit_s")),
        ("", "generations interrupted at the stop", str(result["interrupted_at_stop"])),
        ("restart", "launch -> first new step", s("restart_to_first_new_step_s")),
        ("", "  start-up (processes, model, checkpoint)", s("restart_startup_s")),
        ("", "  resume: engines up on the checkpoint's weights", s("resume_engines_and_plan_s")),
        ("", "  the first step after the checkpoint", s("first_new_step_s")),
        ("", "steps thrown away", str(result["steps_discarded"])),
        ("tokens", "generated before the cut", f"{t['generated_before_cut']:,}"),
        ("", "  trained on before the cut", f"{t['consumed_before']:,}"),
        ("", "  dropped before the cut (by the run itself)", f"{t['dropped_before'] + t['off_branch_before']:,}"),
        ("", f"  in flight at the cut ({n['in_flight']} trajectories)", f"{t['in_flight']:,}"),
        ("", f"    kept ({n['continued']} continued; {n['consumed']} trained on, {n['finished']} waiting)",
         f"{t['kept']:,}"),
        ("", f"    dropped as stale ({n['stale_at_restart']} at the restart, {n['stale_later']} later)",
         f"{t['stale']:,}"),
        ("", "    still in flight at the end", f"{t['open_at_end']:,}"),
        ("", "    LOST (aborted, failed, off the branch)", f"{t['lost']:,}"),
    ]
    return format_table(("", "figure", "value"), rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = read_recipe_mapping(args.recipe)
    output_dir = (args.out.parent / "preemption").absolute()
    data = bench_recipe(base, args.steps, output_dir)
    recipe_path = output_dir / f"{data['name']}.yaml"
    output_dir.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"== {data['name']}: {args.steps} steps, SIGTERM to every rank after step {args.cut_after}, "
          "then --resume", flush=True)
    run_dir, seen, before = cut_and_resume(recipe_path, output_dir, args.cut_after)
    result = {"bench": "preemption", "recipe": str(args.recipe), "steps": args.steps, "cut_after": args.cut_after,
              "run_dir": str(run_dir), **measure(run_dir, seen, before)}
    print(f"preemption, recipe {args.recipe}: {args.steps} steps, cut by {result['signal']} after step "
          f"{result['checkpoint_step']}")
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_as_script(main)
