"""Benchmark: end-to-end throughput of an RL recipe and where each step's time goes, per pipeline mode.

    python -m sfhpc.bench.pipeline [--recipe recipes/demo.yaml] [--steps 30] [--modes async,sync]

Runs the recipe on this machine (``sfhpc run``: mpiexec, real vLLM engines, real training) once per
mode for a short step budget, in one invocation so the modes see the same machine:

* ``async``: the recipe as written if it is disaggregated (trainer and rollout on ranks of their own);
* ``sync``: the same recipe colocated (rollout on the trainer's ranks), generate-then-train.

From each run's ``metrics.jsonl`` it reports trained tokens/s end to end (tokens in the training batches
over the summed step times), generated tokens/s, and how a step's time splits between *waiting for the
batch* (the trainer idles: its bubble), *training* and *weight sync* (engines paused: rollout's bubble;
in sync mode rollout also idles while the trainer trains). The first step (engine warm-up) is left out.
Model build, warm start and engine start are not in the step times. Results: ``runs/bench/pipeline.json``
and a bar chart ``runs/bench/pipeline.png``; each run's own folder is under ``runs/bench/pipeline/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from sfhpc.bench import read_recipe_mapping, run_as_script
from sfhpc.errors import SfhpcError
from sfhpc.table import format_table

MODES = ("async", "sync")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sfhpc.bench.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, default=Path("recipes/demo.yaml"))
    p.add_argument("--steps", type=int, default=30, help="training steps per mode (the first is left out)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--out", type=Path, default=Path("runs/bench/pipeline.json"), help="JSON result file")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        raise SfhpcError(f"--modes: unknown mode {unknown[0] if unknown else '(none)'!r}; choose from "
                         + ", ".join(MODES))
    if args.steps < 2:
        raise SfhpcError("--steps must be at least 2 (the first step is left out)")
    return args


def recipe_for_mode(base: dict[str, Any], mode: str, steps: int, output_dir: Path) -> dict[str, Any]:
    """The base recipe (as loaded from YAML) for one mode and a short budget."""
    recipe = json.loads(json.dumps(base))  # a deep copy of plain YAML data
    recipe["name"] = f"{base.get('name', 'recipe')}-{mode}"
    recipe["output_dir"] = str(output_dir)
    budgets = recipe.setdefault("budgets", {})
    budgets["steps"] = steps
    budgets.pop("wall_minutes", None)
    recipe.setdefault("pipeline", {})["mode"] = mode
    roles = recipe.setdefault("roles", {})
    if mode == "sync":
        trainer = roles.setdefault("trainer", {})
        trainer["tags"] = sorted(set(trainer.get("tags", ["train"])) | {"rollout"})
        roles["rollout"] = {"colocate_with": "trainer"}
    elif "colocate_with" in roles.get("rollout", {}):
        raise SfhpcError("async mode needs a disaggregated recipe (rollout on ranks of its own); "
                         f"{base.get('name')!r} colocates rollout with the trainer")
    return recipe


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput and the split of step time, over the steps after the first."""
    steady = rows[1:]
    step_s = sum(r["step_s"] for r in steady)
    train_s = sum(r["train_s"] for r in steady)
    sync_s = sum(r["sync_s"] for r in steady)
    trained = sum(r["trained_tokens"] for r in steady)
    generated = sum(r["generated_tokens"] for r in steady)
    return {"steps": len(steady), "step_seconds": step_s,
            "median_step_s": statistics.median(r["step_s"] for r in steady),
            "trained_tokens": trained, "generated_tokens": generated,
            "trained_tokens_per_s": trained / step_s, "generated_tokens_per_s": generated / step_s,
            "wait_share": max(0.0, step_s - train_s - sync_s) / step_s, "train_share": train_s / step_s,
            "sync_share": sync_s / step_s, "reward_first": rows[0]["reward_mean"],
            "reward_last": rows[-1]["reward_mean"], "max_staleness": max(r.get("max_staleness", 0) for r in rows)}


def run_mode(recipe_data: dict[str, Any], path: Path) -> tuple[Path, dict[str, Any]]:
    """Write `recipe_data` to `path`, run it with ``sfhpc run`` and summarize its metrics."""
    from sfhpc.config import load_recipe
    from sfhpc.launch.local import local_cluster_map, run_local
    from sfhpc.launch.resolve import resolve
    from sfhpc.launch.rundir import new_run_dir
    from sfhpc.rl.program import check_runnable

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe_data, sort_keys=False))
    recipe = load_recipe(str(path))
    check_runnable(recipe)
    plan = resolve(recipe, local_cluster_map(recipe))
    run_dir = new_run_dir(recipe.output_dir, recipe.name)
    print(f"== {recipe.name}: {plan.world_size} ranks, run folder {run_dir}", flush=True)
    if run_local(plan, str(path), None, run_dir) != 0:
        raise SfhpcError(f"the {recipe.pipeline.mode} run failed; its logs are in {run_dir / 'logs'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return run_dir, summarize(rows)


def plot(results: list[dict[str, Any]], out: Path) -> Path | None:
    """Mean seconds per step, split into wait for batch / train / weight sync, one bar per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.7 * len(results)))
    labels = [f"{r['mode']}\n{r['trained_tokens_per_s']:,.0f} trained tok/s" for r in results]
    left = [0.0] * len(results)
    for key, name, color in (("wait_share", "waiting for the batch (trainer idle)", "tab:gray"),
                             ("train_share", "training", "tab:blue"),
                             ("sync_share", "weight sync (engines paused)", "tab:orange")):
        widths = [r[key] * r["step_seconds"] / r["steps"] for r in results]
        ax.barh(labels, widths, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds per training step (mean over the steps after the first)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.1 * len(results)), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = read_recipe_mapping(args.recipe)
    bench_dir = args.out.parent
    results = []
    for mode in args.modes:
        data = recipe_for_mode(base, mode, args.steps, bench_dir / "pipeline")
        run_dir, summary = run_mode(data, bench_dir / "pipeline" / f"{data['name']}.yaml")
        results.append({"mode": mode, "run_dir": str(run_dir), **summary})
    rows = [[r["mode"], str(r["steps"]), f"{r['median_step_s']:.2f}", f"{r['trained_tokens_per_s']:,.0f}",
             f"{r['generated_tokens_per_s']:,.0f}", f"{100 * r['wait_share']:.0f}%", f"{100 * r['train_share']:.0f}%",
             f"{100 * r['sync_share']:.0f}%", str(r["max_staleness"])] for r in results]
    print(f"pipeline throughput, recipe {args.recipe}, {args.steps} steps per mode (first step left out)")
    print(format_table(["mode", "steps", "median step s", "trained tok/s", "generated tok/s", "wait for batch",
                        "train", "weight sync", "max staleness"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "pipeline", "recipe": str(args.recipe), "steps": args.steps,
                                    "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    chart = plot(results, args.out.with_suffix(".png"))
    if chart is not None:
        print(f"chart: {chart}")
    return 0


if __name__ == "__main__":
    run_as_script(main)
