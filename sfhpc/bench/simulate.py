"""Benchmark: the pipeline modes at cluster scale, simulated (compute modelled, scheduling real).

    sfhpc bench simulate [--cluster recipes/cluster-h100-l40s.yaml] [--sizes 1024,2048,4096,8192]
                         [--modes sync,async,seamless] [--out runs/bench/simulate]

The cluster tag map is scaled to each size (its trainer pool of H100 nodes and its rollout pool of L40S
nodes in the map's proportion), and each mode runs the same long-tailed workload (and, at the smallest
size, the multi-turn one) for a few training steps on a discrete-event clock (`sfhpc.sim`). The episodes
go out through the project's `Scheduler` (by load, lending and reclaiming in ``seamless``); decode,
prefill, training, weight sync and lend/reclaim take the times of `sfhpc.sim.cost_model` (published
H100/L40S figures, cited there). Per mode and size: trained tokens/s, bubble fraction per role (from the
scheduler's timeline, as a run reports it), tokens dropped as stale, staleness, lend and reclaim counts,
reclaim latency (batch ready -> training started). Writes ``simulate.json``, ``simulate.txt`` (the table),
``simulate.png`` and, for the smallest size, ``simulate-<mode>.trace.json`` (a Chrome trace) into ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sfhpc.bench import run_as_script
from sfhpc.config.cluster import ClusterMap, load_cluster_map
from sfhpc.errors import SfhpcError
from sfhpc.rl.pipeline_policy import MODES
from sfhpc.sim.cluster import scaled_cluster
from sfhpc.sim.cost_model import MODELS, CostModel
from sfhpc.sim.pipeline import SimConfig, SimResult, simulate
from sfhpc.sim.workload import WORKLOADS, workload_named
from sfhpc.table import format_table

DEFAULT_SIZES = (1024, 2048, 4096, 8192)
# The targets for seamless (benchmark figures, not tests).
TARGET_BUBBLE = 0.02
TARGET_VS_SYNC = 1.8
TARGET_VS_ASYNC = 1.5
TARGET_DROPPED = 0.02  # of the tokens generated, in every mode
MODELLED = ("compute is modelled (decode, prefill, training, weight sync, lend/reclaim from the cost model); "
            "the scheduling is the project's Scheduler on a discrete-event clock")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SfhpcError(f"{what}: expected comma-separated whole numbers, found {text!r}") from None
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sfhpc bench simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", type=Path, default=Path("recipes/cluster-h100-l40s.yaml"), help="cluster tag map")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="GPU counts (comma-separated)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--workload", default="long-tail", help="workload at every size: " + ", ".join(WORKLOADS))
    p.add_argument("--multi-turn-sizes", default=None,
                   help="sizes that also run the multi-turn workload (default: the smallest size; 'none': no "
                        "size)")
    p.add_argument("--model", default="qwen2.5-7b", help="model of the cost model: " + ", ".join(MODELS))
    p.add_argument("--samples-per-gpu", type=int, default=8,
                   help="samples per training step per GPU of the cluster (the batch grows with the cluster)")
    p.add_argument("--steps", type=int, default=6, help="training steps per mode")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the figures")
    p.add_argument("--max-staleness", type=int, default=2,
                   help="async and seamless: how far rollout runs ahead, as pipeline.max_staleness (the site "
                        "recipe's 2)")
    p.add_argument("--max-token-lag", type=int, default=None,
                   help="drop groups holding a token that lags more versions, as pipeline.max_token_lag (default: "
                        "none dropped for its age)")
    p.add_argument("--no-rebalance", dest="rebalance", action="store_false",
                   help="seamless: no rebalancing (by default a lent rank that runs dry takes half the running "
                        "sequences of the most loaded rollout rank, as in a run; pipeline.rebalance)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="simulations run at once")
    p.add_argument("--out", type=Path, default=Path("runs/bench/simulate"), help="output folder")
    args = p.parse_args(argv)
    args.sizes = _ints(args.sizes, "--sizes")
    if not args.sizes or min(args.sizes) < 2:
        raise SfhpcError("--sizes: give GPU counts of at least 2, e.g. --sizes 1024,2048")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        raise SfhpcError(f"--modes: unknown mode {unknown[0] if unknown else '(none)'!r}; choose from "
                         + ", ".join(MODES))
    workload_named(args.workload)
    if args.multi_turn_sizes is None:
        args.multi_turn_sizes = [min(args.sizes)] if args.workload != "multi-turn" else []
    elif args.multi_turn_sizes.strip().lower() == "none":
        args.multi_turn_sizes = []
    else:
        args.multi_turn_sizes = _ints(args.multi_turn_sizes, "--multi-turn-sizes")
    if args.model not in MODELS:
        raise SfhpcError(f"--model: unknown model {args.model!r} (known: {', '.join(MODELS)})")
    for name in ("samples_per_gpu", "steps", "jobs"):
        if getattr(args, name) < 1:
            raise SfhpcError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.warmup_steps < args.steps:
        raise SfhpcError(f"--warmup-steps must be from 0 to --steps - 1 ({args.steps - 1})")
    if args.max_token_lag is not None and args.max_token_lag < 0:
        raise SfhpcError("--max-token-lag must be 0 or more")
    if args.max_staleness < 0:
        raise SfhpcError("--max-staleness must be 0 or more")
    return args


@dataclasses.dataclass(frozen=True)
class Task:
    workload: str
    gpus: int
    mode: str
    timeline: bool  # record the busy-GPU timeline (for the chart)


def _run_task(cluster_map: ClusterMap, cost: CostModel, args: argparse.Namespace, task: Task) -> dict[str, Any]:
    cluster = scaled_cluster(cluster_map, task.gpus)
    workload = workload_named(task.workload)
    prompts = max(1, cluster.gpus * args.samples_per_gpu // workload.group_size)
    config = SimConfig(task.mode, workload, prompts_per_step=prompts, steps=args.steps,
                       warmup_steps=args.warmup_steps, max_staleness=args.max_staleness,
                       max_token_lag=args.max_token_lag, seed=args.seed, timeline=task.timeline,
                       intervals=task.timeline, rebalance=args.rebalance)
    started = time.process_time()
    result = simulate(cluster, cost, config)
    return {"workload": task.workload, "prompts_per_step": prompts, "cpu_s": time.process_time() - started,
            "cluster": cluster.describe(), "result": result}


def run_all(cluster_map: ClusterMap, cost: CostModel, args: argparse.Namespace,
            tasks: list[Task]) -> list[dict[str, Any]]:
    """Every task, `args.jobs` at a time (processes: the simulations are pure Python)."""
    if args.jobs == 1 or len(tasks) == 1:
        return [_run_task(cluster_map, cost, args, t) for t in tasks]
    context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        # Largest first, so the long ones do not start last.
        order = sorted(range(len(tasks)), key=lambda i: -tasks[i].gpus)
        futures = {i: pool.submit(_run_task, cluster_map, cost, args, tasks[i]) for i in order}
        return [futures[i].result() for i in range(len(tasks))]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run, with its throughput relative to sync and async of the same workload and size."""
    rows = []
    by_key = {(r["workload"], r["result"].gpus, r["result"].mode): r["result"] for r in runs}
    for run in runs:
        res: SimResult = run["result"]
        row = {"workload": run["workload"], "prompts_per_step": run["prompts_per_step"], "cpu_s": run["cpu_s"],
               "cluster": run["cluster"], **res.as_json()}
        for base in ("sync", "async"):
            other = by_key.get((run["workload"], res.gpus, base))
            row[f"vs_{base}"] = res.trained_tokens_per_s / other.trained_tokens_per_s if other else None
        generated = res.generated_tokens + res.tokens_discarded
        row["discarded_share"] = res.tokens_discarded / generated if generated else 0.0
        row["bubble_trainer"] = _role_bubble(res.bubble, "trainer")
        row["bubble_rollout"] = res.bubble.get("rollout")
        rows.append(row)
    return rows


def _role_bubble(bubble: dict[str, float], role: str) -> float | None:
    """The bubble of the ranks with `role` ("trainer,rollout" is a colocated trainer rank)."""
    for name, value in bubble.items():
        if name != "all" and role in name.split(","):
            return value
    return None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_results(rows: list[dict[str, Any]]) -> str:
    header = ("workload", "GPUs", "mode", "trained tok/s", "vs sync", "vs async", "step s", "bubble trainer",
              "bubble rollout", "bubble all", "stale dropped", "staleness mean/max", "lends", "reclaims",
              "ready->train s", "cpu s")
    table = [(r["workload"], f"{r['gpus']:,}", r["mode"], f"{r['trained_tokens_per_s']:,.0f}", _ratio(r["vs_sync"]),
              _ratio(r["vs_async"]), f"{r['step_s_mean']:.1f}", _pct(r["bubble_trainer"]), _pct(r["bubble_rollout"]),
              _pct(r["bubble"]["all"]), _pct(r["discarded_share"]),
              f"{r['staleness_mean']:.2f}/{r['staleness_max']}", f"{r['lends']:,}", f"{r['reclaims']:,}",
              f"{r['reclaim_latency_mean_s']:.2f}", f"{r['cpu_s']:.1f}") for r in rows]
    return format_table(header, table)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """For each workload and size: the targets, met or missed (tokens dropped in every mode; the bubble and
    the speed-ups of seamless)."""
    lines = []
    for r in rows:
        dropped = r["discarded_share"]
        if dropped > TARGET_DROPPED:
            lines.append(f"{r['mode']}, {r['workload']}, {r['gpus']:,} GPUs: {_pct(dropped)} of the tokens generated "
                         f"dropped (<= {TARGET_DROPPED:.0%}: missed)")
        if r["mode"] != "seamless":
            continue
        checks = [f"bubble {_pct(r['bubble']['all'])} (<= {TARGET_BUBBLE:.0%}: "
                  f"{'met' if r['bubble']['all'] <= TARGET_BUBBLE else 'missed'})",
                  f"dropped {_pct(dropped)} (<= {TARGET_DROPPED:.0%}: "
                  f"{'met' if dropped <= TARGET_DROPPED else 'missed'})"]
        for base, goal in (("sync", TARGET_VS_SYNC), ("async", TARGET_VS_ASYNC)):
            if r[f"vs_{base}"] is not None:
                checks.append(f"{_ratio(r[f'vs_{base}'])} {base} (>= {goal}x: "
                              f"{'met' if r[f'vs_{base}'] >= goal else 'missed'})")
        note = f"; {r['note']}" if r["note"] else ""
        lines.append(f"seamless, {r['workload']}, {r['gpus']:,} GPUs: " + ", ".join(checks) + note)
    return lines


def plot(rows: list[dict[str, Any]], runs: list[dict[str, Any]], out: Path) -> Path | None:
    """Trained tokens/s and bubble fraction per mode and size; the busy GPUs over time at the smallest size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workload = rows[0]["workload"]
    main = [r for r in rows if r["workload"] == workload]
    modes = list(dict.fromkeys(r["mode"] for r in main))
    sizes = sorted({r["gpus"] for r in main})
    timelines = [run for run in runs if run["workload"] == workload and run["result"].gpus == sizes[0]
                 and run["result"].timeline.get("rollout")]
    fig, axes = plt.subplots(2 + len(timelines), 1, figsize=(9, 6 + 1.8 * len(timelines)),
                             gridspec_kw={"height_ratios": [2, 2] + [1.2] * len(timelines)})
    colors = {"sync": "tab:gray", "async": "tab:blue", "seamless": "tab:green"}
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(sizes))]
        by_size = {r["gpus"]: r for r in main if r["mode"] == mode}
        axes[0].bar(xs, [by_size[s]["trained_tokens_per_s"] / s if s in by_size else 0 for s in sizes], width,
                    color=colors.get(mode), label=mode)
        axes[1].bar(xs, [100 * by_size[s]["bubble"]["all"] if s in by_size else 0 for s in sizes], width,
                    color=colors.get(mode), label=mode)
    for ax, label in ((axes[0], "trained tokens/s per GPU"), (axes[1], "bubble fraction, all ranks (%)")):
        ax.set_xticks(range(len(sizes)), [f"{s:,} GPUs" for s in sizes])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[0].set_title(f"simulated ({workload} workload): {MODELLED.split(';')[0]}", fontsize=9)
    axes[1].axhline(100 * TARGET_BUBBLE, color="tab:red", linestyle=":", linewidth=1)
    for ax, run in zip(axes[2:], timelines):
        res: SimResult = run["result"]
        for role, color, total in (("trainer", "tab:orange", res.trainer_gpus),
                                   ("rollout", "tab:blue", res.rollout_gpus)):
            points = res.timeline.get(role) or []
            if points and total:
                ax.step([t for t, _ in points], [n / total for _, n in points], where="post", color=color,
                        linewidth=0.8, label=f"{role} GPUs generating")
        for phase in res.phases:
            if "train_start" in phase and "sync_start" in phase:
                ax.axvspan(phase["train_start"], phase["sync_start"], color="tab:red", alpha=0.25, linewidth=0)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(res.mode, fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    if timelines:
        axes[2].set_title(f"{sizes[0]:,} GPUs: share of GPUs generating over simulated time (red: training)",
                          fontsize=9)
        axes[-1].set_xlabel("simulated seconds")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cluster_map = load_cluster_map(args.cluster)
    for size in args.sizes:
        scaled_cluster(cluster_map, size)  # a map the simulation cannot use fails here, before any work
    sample = scaled_cluster(cluster_map, args.sizes[0])
    gpu_types = (sample.trainer_pool.gpu_type or "", sample.rollout_pool.gpu_type or "")
    cost = CostModel.published(args.model, tuple(dict.fromkeys(gpu_types)))
    smallest = min(args.sizes)
    # The smallest size's runs record the busy GPUs over time (the chart) and every rank's intervals (a trace).
    tasks = [Task(args.workload, size, mode, timeline=size == smallest) for size in args.sizes for mode in args.modes]
    tasks += [Task("multi-turn", size, mode, timeline=False) for size in args.multi_turn_sizes for mode in args.modes]
    print(f"sfhpc bench simulate: {MODELLED}", flush=True)
    print(cost.describe())
    print(f"cluster map {args.cluster}; {len(tasks)} simulations, {args.jobs} at a time", flush=True)
    started = time.monotonic()
    runs = run_all(cluster_map, cost, args, tasks)
    wall = time.monotonic() - started
    rows = summarize(runs)
    lines = [f"simulated pipeline modes ({MODELLED})",
             cost.describe(),
             *(f"  {c}" for c in dict.fromkeys(r["cluster"] for r in rows)),
             *(f"workload {w.describe()}" for w in {workload_named(r["workload"]) for r in rows}),
             f"{args.samples_per_gpu} samples per GPU per step, {args.steps} steps per mode (first "
             f"{args.warmup_steps} left out), max_staleness {args.max_staleness}, max_token_lag "
             f"{'none' if args.max_token_lag is None else args.max_token_lag}"
             + ("" if args.rebalance else "; seamless does not rebalance (--no-rebalance)"),
             format_results(rows),
             "stale dropped: share of generated tokens in groups dropped as too stale; tokens discarded at weight "
             "updates and reclaims: 0 (interrupted generations continue from their prefix)",
             *targets(rows),
             f"{len(tasks)} simulations in {wall:.1f} s wall ({sum(r['cpu_s'] for r in rows):.1f} s of CPU)"]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulate.txt").write_text(text + "\n")
    (args.out / "simulate.json").write_text(json.dumps({
        "bench": "simulate", "modelled": MODELLED, "cluster_map": str(args.cluster), "cost_model": cost.describe(),
        "model": args.model, "samples_per_gpu": args.samples_per_gpu, "steps": args.steps,
        "warmup_steps": args.warmup_steps, "max_staleness": args.max_staleness,
        "max_token_lag": args.max_token_lag, "seed": args.seed,
        "rebalance": args.rebalance,
        "wall_s": wall, "targets": targets(rows), "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out / 'simulate.json'} and {args.out / 'simulate.txt'}")
    chart = plot(rows, runs, args.out / "simulate.png")
    if chart is not None:
        print(f"chart: {chart}")
    traces = write_traces(runs, args.out)
    if traces:
        print(f"traces (Perfetto, chrome://tracing): {', '.join(str(p) for p in traces)}")
    return 0


def write_traces(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    """`simulate-<mode>.trace.json` per mode of the runs that kept their intervals (the smallest size): one
    track per rank, as `sfhpc traj trace` writes for a run, on the simulated clock (from 0)."""
    import pandas as pd

    from sfhpc.analysis.trace import chrome_trace

    written = []
    for run in runs:
        result: SimResult = run["result"]
        if not result.intervals:
            continue
        frame = pd.DataFrame([dataclasses.asdict(i) for i in result.intervals])
        path = out / f"simulate-{result.mode}.trace.json"
        path.write_text(json.dumps(chrome_trace(frame, [], [])))
        written.append(path)
    return written


if __name__ == "__main__":
    run_as_script(main)
