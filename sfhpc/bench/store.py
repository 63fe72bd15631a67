"""Benchmark: how fast the trajectory manager and its HDF5 store take in a run's tokens.

    python -m sfhpc.bench.store [--trajectories 3000] [--arrival-rate 50000] [--out runs/bench/store.json]

Two measurements, both through the real `TrajectoryManager` and `TrajectoryStore` (flushed per batch):

1. *Ingest*: agents' calls replayed back to back, as fast as the controller takes them: multi-turn
   trajectories of ~1k tokens (prompt, generated turns, tool observations, some interrupted and continued),
   GRPO groups, a training batch taken (and the store flushed) every few groups. Reports tokens/s and
   trajectories/s, with and without the store, and the store's share of that time.
2. *Run loop*: the same calls paced at a modelled token arrival rate (a timing model standing in for the
   rollout engines: no engine runs), to measure the share of the controller's wall time spent in store
   appends and flushes. Also reported: the arrival rate at which that share would reach 2%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sfhpc.bench import run_as_script
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.table import format_table

PROMPT, TURNS, GENERATED, OBSERVATION = 256, 3, 200, 80  # ~1,016 tokens per trajectory
INTERRUPTED_SHARE = 4  # every 4th trajectory is interrupted mid-turn and continued (a partial rollout)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Pre-made token lists, so the benchmark times the data plane, not a random number generator."""

    prompts: list[list[int]]
    generated: list[list[int]]
    logprobs: list[list[float]]
    observations: list[list[int]]

    @classmethod
    def make(cls, seed: int = 0, variants: int = 16) -> Workload:
        rng = np.random.default_rng(seed)
        return cls(prompts=[rng.integers(0, 50_000, PROMPT).tolist() for _ in range(variants)],
                   generated=[rng.integers(0, 50_000, GENERATED).tolist() for _ in range(variants)],
                   logprobs=[(-rng.random(GENERATED) * 3).tolist() for _ in range(variants)],
                   observations=[rng.integers(0, 50_000, OBSERVATION).tolist() for _ in range(variants)])


def run_trajectory(manager: TrajectoryManager, work: Workload, n: int, group: str, version: int) -> int:
    """One agent's trajectory, as the endpoint would record it; returns the number of tokens recorded."""
    v = len(work.prompts)
    history = list(work.prompts[n % v])
    tid = manager.start(history, task="bench", group=group, metadata={"n": n})
    for turn in range(TURNS):
        gen, lps = work.generated[(n + turn) % v], work.logprobs[(n + turn) % v]
        if n % INTERRUPTED_SHARE == 0 and turn == 1:  # a weight update lands mid-turn
            half = GENERATED // 2
            manager.add_generated(tid, gen[:half], lps[:half], version, engine="rank-1", finish_reason="abort")
            manager.interrupt(tid)
            cont = manager.continuation(tid, GENERATED)
            manager.add_generated(tid, gen[half:half + cont.remaining_tokens], lps[half:half + cont.remaining_tokens],
                                  version + 1, engine="rank-2", finish_reason="stop")
        else:
            manager.add_generated(tid, gen, lps, version, engine="rank-1", finish_reason="stop")
        history += gen
        if turn < TURNS - 1:
            history += work.observations[(n + turn) % v]
            manager.observe(tid, history)
    manager.finish(tid, reward=float(n % 2), turn_rewards=[0.0] * TURNS)
    return len(history)


@dataclasses.dataclass
class Phase:
    seconds: float = 0.0
    tokens: int = 0
    trajectories: int = 0
    store_seconds: float = 0.0
    flushes: int = 0
    batches: int = 0

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens / self.seconds,
                "trajectories_per_s": self.trajectories / self.seconds,
                "store_share": self.store_seconds / self.seconds}


def run_phase(manager: TrajectoryManager, work: Workload, trajectories: int, group_size: int, batch_groups: int,
              arrival_rate: float | None = None) -> Phase:
    """Record `trajectories` trajectories in groups, taking a batch every `batch_groups` groups.

    With `arrival_rate`, tokens are released no faster than that many per second (the engines' pace).
    """
    phase = Phase()
    store = manager.store
    store_before = (store.stats.seconds, store.stats.flushes) if store is not None else (0.0, 0)
    began = time.perf_counter()
    version = 0
    for n in range(trajectories):
        phase.tokens += run_trajectory(manager, work, n, f"g{n // group_size}", version)
        phase.trajectories += 1
        if (n + 1) % (group_size * batch_groups) == 0:
            batch = manager.take_batch(policy_version=version, num_groups=batch_groups, group_size=group_size)
            if batch is None:
                raise RuntimeError("the benchmark's batch was not ready: a bug in the manager")
            phase.batches += 1
            version += 1
        if arrival_rate is not None:
            due = began + phase.tokens / arrival_rate
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
    manager.flush()
    phase.seconds = time.perf_counter() - began
    if store is not None:
        phase.store_seconds = store.stats.seconds - store_before[0]
        phase.flushes = store.stats.flushes - store_before[1]
    return phase


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.bench.store", description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=3000, help="trajectories in the ingest phase")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=8, help="groups per training batch (one flush each)")
    parser.add_argument("--arrival-rate", type=float, default=50_000.0,
                        help="modelled token arrival rate of the run-loop phase, tokens/s (timing model)")
    parser.add_argument("--run-seconds", type=float, default=8.0, help="length of the run-loop phase")
    parser.add_argument("--out", default="runs/bench/store.json", help="where to write the JSON result")
    parser.add_argument("--dir", default=None, help="folder for the store files (default: a temporary one)")
    args = parser.parse_args(argv)
    batch = args.group_size * args.batch_groups
    args.trajectories = max(batch, args.trajectories // batch * batch)

    work = Workload.make()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        # Warm-up (imports, allocator, HDF5 caches), then the real phases, each with a fresh store.
        run_phase(TrajectoryManager(), work, batch, args.group_size, args.batch_groups)
        memory = run_phase(TrajectoryManager(), work, args.trajectories, args.group_size, args.batch_groups)
        stored_mgr = TrajectoryManager(TrajectoryStore.create(Path(folder) / "ingest.h5"), flush_every=batch)
        ingest = run_phase(stored_mgr, work, args.trajectories, args.group_size, args.batch_groups)
        stored_mgr.close()
        file_mb = (Path(folder) / "ingest.h5").stat().st_size / 1e6
        paced_n = max(batch, int(args.arrival_rate * args.run_seconds / (PROMPT + TURNS * GENERATED
                                                                          + (TURNS - 1) * OBSERVATION)))
        paced_n = paced_n // batch * batch or batch
        paced_mgr = TrajectoryManager(TrajectoryStore.create(Path(folder) / "run.h5"), flush_every=batch)
        paced = run_phase(paced_mgr, work, paced_n, args.group_size, args.batch_groups, args.arrival_rate)
        paced_mgr.close()

    seconds_per_token = ingest.store_seconds / ingest.tokens
    result = {
        "benchmark": "store",
        "workload": {"tokens_per_trajectory": ingest.tokens / ingest.trajectories, "group_size": args.group_size,
                     "trajectories_per_batch": batch, "turns": TURNS,
                     "interrupted_share": 1 / INTERRUPTED_SHARE},
        "ingest_without_store": memory.as_dict(),
        "ingest": {**ingest.as_dict(), "file_mb": file_mb},
        "run_loop": {**paced.as_dict(), "arrival_rate_tokens_per_s": args.arrival_rate,
                     "arrival_model": "timing model (no engine): tokens released at a fixed rate"},
        "store_tokens_per_s": 1 / seconds_per_token,
        "arrival_rate_at_2pct_store_share": 0.02 / seconds_per_token,
        "targets": {"ingest_tokens_per_s": 200_000, "store_share": 0.02},
    }
    rows = [
        ("ingest, manager only", f"{memory.tokens / memory.seconds:,.0f}",
         f"{memory.trajectories / memory.seconds:,.0f}", "-"),
        ("ingest, manager + store", f"{ingest.tokens / ingest.seconds:,.0f}",
         f"{ingest.trajectories / ingest.seconds:,.0f}", f"{ingest.store_seconds / ingest.seconds:.1%}"),
        (f"run loop, {args.arrival_rate:,.0f} tok/s arriving*", f"{paced.tokens / paced.seconds:,.0f}",
         f"{paced.trajectories / paced.seconds:,.0f}", f"{paced.store_seconds / paced.seconds:.2%}"),
    ]
    print(format_table(("phase", "tokens/s", "trajectories/s", "store share of wall time"), rows))
    print(f"store time: {seconds_per_token * 1e9:.0f} ns per token in appends + flushes ({1 / seconds_per_token:,.0f} "
          f"tokens per store-second; {ingest.flushes} flushes, {file_mb:.0f} MB); its share of wall time would "
          f"reach 2% at {0.02 / seconds_per_token:,.0f} tokens/s arriving")
    print("* arrival paced by a timing model (no rollout engine runs in this benchmark)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"result written to {args.out}")
    return 0


if __name__ == "__main__":
    run_as_script(main)
