"""Benchmark: the analyst's commands on a big store (``sfhpc traj summary``, ``export --format parquet``, ``plot``).

    python -m sfhpc.bench.analysis [--trajectories 1000000] [--out runs/bench/analysis.json] [--dir DIR]

A synthetic store is written with the store's own writer: ~100-token trajectories of a multi-turn agent
(prompt, reply, observation, reply; every 4th reply cut by a weight update and continued by the next
version), GRPO groups of 8, a training step every 8 groups that consumes them (some trained one version
stale), 1 in 40 failed, the last batch still unconsumed. Then each command runs as a user runs it, in
its own process, timed, with its peak memory (the child's maximum resident set, from `os.wait4`).
Targets (1,000,000 trajectories, ~100 M tokens): summary < 30 s with < 4 GiB, export and plot < 60 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sfhpc.bench import run_as_script
from sfhpc.data.store import TrajectoryStore
from sfhpc.data.trajectory import Segment, SegmentKind, Status
from sfhpc.rundir import RunPaths
from sfhpc.table import format_table

PROMPT, REPLY, OBSERVATION, SECOND_REPLY = 40, 40, 10, 10  # 100 tokens per trajectory
GROUP, GROUPS_PER_STEP, FLUSH_EVERY = 8, 8, 4096
CUT_EVERY, FAIL_EVERY = 4, 40
TARGETS = {"summary_s": 30.0, "summary_peak_gib": 4.0, "export_parquet_s": 60.0, "plot_s": 60.0}


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Pre-made segments, so that building the store times the writer, not a random number generator."""

    prompts: list[Segment]
    replies: list[Segment]  # per version
    halves: list[tuple[Segment, Segment]]  # a reply cut at a weight update: (older version, newer version)
    observations: list[Segment]
    second: list[Segment]

    @classmethod
    def make(cls, versions: int, variants: int = 8, seed: int = 0) -> Pieces:
        rng = np.random.default_rng(seed)

        def tokens(n: int) -> np.ndarray:
            return rng.integers(0, 256, n).astype(np.int32)

        def generated(parent: int, fork: int, n: int, version: int, reason: str = "stop") -> Segment:
            return Segment(SegmentKind.GENERATED, parent, fork, tokens(n), (-rng.random(n)).astype(np.float32),
                           np.full(n, version, np.int32), "rollout-0", 0.0, 0.0, reason)

        half = REPLY // 2
        return cls(
            prompts=[Segment.of(SegmentKind.PROMPT, -1, 0, tokens(PROMPT)) for _ in range(variants)],
            replies=[generated(0, PROMPT, REPLY, v) for v in range(versions)],
            halves=[(generated(0, PROMPT, half, v, "abort"), generated(1, half, REPLY - half, v + 1))
                    for v in range(versions)],
            observations=[Segment.of(SegmentKind.OBSERVATION, 1, REPLY, tokens(OBSERVATION)),
                          Segment.of(SegmentKind.OBSERVATION, 2, REPLY - half, tokens(OBSERVATION))],
            second=[generated(2, OBSERVATION, SECOND_REPLY, v) for v in range(versions)]
            + [generated(3, OBSERVATION, SECOND_REPLY, v) for v in range(versions)],
        )


def build_store(path: Path, trajectories: int) -> dict[str, int]:
    """Write the synthetic store at `path`; returns what it holds (trajectories, tokens, steps)."""
    per_step = GROUP * GROUPS_PER_STEP
    steps = trajectories // per_step
    versions = steps + 2
    pieces = Pieces.make(versions)
    rewards = np.random.default_rng(1).random(per_step)
    store = TrajectoryStore.create(path, run_metadata={"benchmark": "analysis"})
    tokens = 0
    batch: list[tuple[str, float]] = []
    now = time.time()
    for n in range(trajectories):
        step = n // per_step
        version = step  # sampled by the trainer's version at its step, or (every 3rd group) one before
        if (n // GROUP) % 3 == 2 and step > 0:
            version = step - 1
        tid = f"t{n:07d}"
        store.add_trajectory(tid, task="bench", group=f"g{n // GROUP}", created=now)
        store.add_segment(tid, pieces.prompts[n % len(pieces.prompts)])
        if n % CUT_EVERY == 0:  # a weight update cut this reply; the next version continued it
            first, rest = pieces.halves[version]
            store.add_segment(tid, first)
            store.add_segment(tid, rest)
            store.add_segment(tid, pieces.observations[1])
            store.add_segment(tid, pieces.second[versions + version + 1])
        else:
            store.add_segment(tid, pieces.replies[version])
            store.add_segment(tid, pieces.observations[0])
            store.add_segment(tid, pieces.second[version])
        tokens += PROMPT + REPLY + OBSERVATION + SECOND_REPLY
        if n % FAIL_EVERY == FAIL_EVERY - 1:
            store.set_status(tid, Status.FAILED, when=now, reason="TimeoutError: tool call")
        else:
            reward = float(rewards[n % per_step]) * (0.5 + 0.5 * step / max(1, steps))  # a rising curve
            store.set_status(tid, Status.FINISHED, when=now, reward=reward, turn_rewards=(0.0, reward))
            batch.append((tid, reward))
        if (n + 1) % per_step == 0 and step < steps - 1:  # the last batch stays unconsumed
            store.mark_consumed(step, [tid for tid, _ in batch], policy_version=step + 1, when=now)
            for consumed, reward in batch:  # as the manager does: every status record carries the rewards
                store.set_status(consumed, Status.CONSUMED, when=now, reward=reward, turn_rewards=(0.0, reward))
            batch = []
        if (n + 1) % FLUSH_EVERY == 0:
            store.flush()
    store.close()
    return {"trajectories": trajectories, "tokens": tokens, "steps": max(0, steps - 1)}


def timed(command: list[str], log: Path) -> dict[str, float | int]:
    """Run `command` in a child process: wall seconds, CPU seconds (user + system: the work itself, whatever
    else the machine runs), peak resident memory (GiB) and exit code."""
    began = time.perf_counter()
    with log.open("w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_gib": usage.ru_maxrss * 1024 / 2**30, "exit_code": child.returncode}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.bench.analysis", description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1_000_000)
    parser.add_argument("--out", default="runs/bench/analysis.json", help="where to write the JSON result")
    parser.add_argument("--dir", default=None, help="folder for the store and outputs (default: a temporary one)")
    args = parser.parse_args(argv)
    args.trajectories = max(GROUP * GROUPS_PER_STEP * 2, args.trajectories)

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        run = Path(folder) / "run"
        run.mkdir()
        began = time.perf_counter()
        held = build_store(RunPaths(run).store, args.trajectories)
        build_s = time.perf_counter() - began
        store_gb = RunPaths(run).store.stat().st_size / 1e9
        sfhpc = [sys.executable, "-m", "sfhpc", "traj"]
        figures = {
            "summary": timed([*sfhpc, "summary", str(run)], Path(folder) / "summary.log"),
            "export_parquet": timed([*sfhpc, "export", str(run), "--format", "parquet", "--out",
                                     str(Path(folder) / "t.parquet")], Path(folder) / "export.log"),
            "plot": timed([*sfhpc, "plot", str(run), "--out", str(Path(folder) / "t.png")], Path(folder) / "plot.log"),
        }
        failed = {name: (Path(folder) / f"{name.split('_')[0]}.log").read_text()[-2000:]
                  for name, f in figures.items() if f["exit_code"] != 0}
        parquet_mb = (Path(folder) / "t.parquet").stat().st_size / 1e6 if not failed else None

    met = {"summary_s": figures["summary"]["seconds"] < TARGETS["summary_s"],
           "summary_peak_gib": figures["summary"]["peak_gib"] < TARGETS["summary_peak_gib"],
           "export_parquet_s": figures["export_parquet"]["seconds"] < TARGETS["export_parquet_s"],
           "plot_s": figures["plot"]["seconds"] < TARGETS["plot_s"]}
    result = {"benchmark": "analysis", "store": {**held, "file_gb": store_gb, "build_s": build_s},
              "commands": figures, "parquet_mb": parquet_mb, "targets": TARGETS, "met": met}
    rows = [(name.replace("_", " --format ") if name.startswith("export") else name, f"{f['seconds']:.1f} s",
             f"{f['cpu_seconds']:.1f} s", f"{f['peak_gib']:.2f} GiB", "ok" if f["exit_code"] == 0 else
             f"exit {f['exit_code']}") for name, f in figures.items()]
    print(f"store: {held['trajectories']:,} trajectories, {held['tokens']:,} tokens, {held['steps']:,} training steps, "
          f"{store_gb:.2f} GB (written in {build_s:.0f} s)")
    print(format_table(("command", "wall time", "CPU time", "peak memory", "result"), rows))
    print("targets: summary < 30 s and < 4 GiB, export --format parquet < 60 s, plot < 60 s: "
          + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()))
    for name, tail in failed.items():
        print(f"{name} failed:\n{tail}", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"result written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    run_as_script(main)
