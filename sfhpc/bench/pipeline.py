"""Benchmark: the same long-tailed workload under ``sync``, ``async`` and ``seamless`` on the same ranks.

    sfhpc bench pipeline [--scales small,timing] [--modes sync,async,seamless] [--ranks 16] [--steps 8]
                         [--timing-workload grpo-7b|short] [--timing-speedup K] [--against-simulator]

One invocation runs every mode at each scale, one after the other on this machine (``mpiexec``, as
``sfhpc run`` does), and reports per mode: trained tokens/s (the tokens of the training batches over the
summed step times, the first step left out), the bubble fraction per role (waiting rank-seconds over all
rank-seconds, from the run's timeline), how long a weight update paused each engine (the median of the
rollout ranks' ``syncing`` intervals), tokens discarded (policy-generated tokens never trained on and
off every trajectory's branch: stale, aborted or failed trajectories, and cut generations that were not
continued), mean and max staleness of the trained tokens, how many times trainer ranks were lent to
rollout and reclaimed, and the reclaim latency (the batch ready -> training started).

Scales:

* ``small``: the recipe ``--recipe`` (default ``recipes/bench-pipeline.yaml``: the ``repeat-letter`` task,
  whose reply lengths are long-tailed) with real vLLM engines and real torch training. Measured.
* ``timing``: ``--ranks`` ranks (16-64) with the test engine and trainer as timing models: decode steps,
  prompts, weight loads and training steps *sleep* the time that `sfhpc.sim.cost_model` gives: by default
  the published figures of a 7B model on an L40S engine and an H100 trainer (the simulator's), with
  ``--calibrate`` those of the small scale's ``async`` run (vLLM on this machine's CPU), with
  ``--calibrate-from`` an earlier run's. The scheduler, trajectory manager, store, endpoint, agents, weight
  broadcast and MPI are the real ones; only compute is modelled, and the output says so, and which costs.
  ``--timing-workload`` shapes the steps (`TIMING_WORKLOADS`): ``grpo-7b`` (the default) like a 7B GRPO step,
  whose replies reach thousands of tokens and whose generation lasts most of a step; ``agent``, the same
  shape played by a multi-turn agent program of its own (`sfhpc.bench.timing_agent`: three calls an episode,
  each reply from the long tail, a tool's result between them), whose episodes move by their generations;
  ``short``, replies of at most 128 tokens, where a step is shorter than a version's transfer.

Modes on the same ranks: ``async`` runs the recipe as written (trainer and rollout on ranks of their own);
``seamless`` is the same with the trainer's nodes tagged ``rollout`` so that idle trainer ranks are lent to
rollout; ``sync`` is generate-then-train on the same ranks and roles (one step's episodes at a time: the
trainer waits for the whole batch, rollout waits while it trains), or with ``--sync-layout colocated``
every one of those ranks both trains and generates. A mode this version cannot run is reported as not
available.

``--against-simulator`` simulates each timing-scale mode on the same configuration and prints the controller's
figures beside the simulator's (`sfhpc.bench.crosscheck`).

Results: ``runs/bench/pipeline.json``, the table on stdout, one timeline chart per scale and mode
(``pipeline-SCALE-MODE.png``: every rank's states over time) with its Chrome trace
(``pipeline-SCALE-MODE.trace.json``, for Perfetto) and a throughput chart (``pipeline.png``);
each run's folder and log are under ``runs/bench/pipeline/SCALE/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from sfhpc.bench import read_recipe_mapping, run_as_script
from sfhpc.data.run_log import read_log
from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths
from sfhpc.table import format_table

MODES = ("sync", "async", "seamless")
SCALES = ("small", "timing")
DEFAULT_RECIPE = Path("recipes/bench-pipeline.yaml")
MIN_TIMING_RANKS = 4  # controller, one trainer, two rollout ranks
# The short workload's pace: three times the cost model's. With the published GPU figures a decode step is
# 23 ms, 7.7 ms at this pace: still several times the real per-token overheads (about a millisecond).
# Calibrated on vLLM on CPU (--calibrate) a step is about 230 ms and a long reply's decode 30 s at the model's
# own pace.
DEFAULT_SPEEDUP = 3.0


@dataclasses.dataclass(frozen=True)
class TimingWorkload:
    """The shape of the timing scale's steps: ``repeat-letter``'s long tail of reply lengths (the test engine
    writes every reply of a group to the asked count, `sfhpc.tasks.long_tail`), the group size, the prompts
    per step for every two rollout ranks, how many sequences of the modelled batch each played one stands for,
    and the pace that keeps one mode's run to minutes on 2 cores (every modelled duration divided by
    `speedup`; the real per-token overheads, about a millisecond, stay a fraction of a modelled decode step)."""

    name: str
    about: str
    group_size: int
    prompts_per_two_rollout_ranks: int
    min_count: int
    max_count: int
    alpha: float
    speedup: float
    # Each played sequence stands for this many of the modelled batch: it costs their decode share of every
    # decode step (``per_sequence_s``), their prefill and their training tokens. A 7B engine decodes hundreds of
    # sequences at once, where the per-sequence share of a step outweighs its fixed part (so more engines finish
    # a batch sooner); 2 cores cannot play every token of such a batch, but can play a few sequences that cost
    # what it costs. Weight transfers and loads are the model's, unscaled.
    batch_weight: int = 1
    # An agent program plays each episode (`sfhpc.bench.timing_agent`): this many calls, each reply drawn from the
    # long tail; 0: the task's own single-turn agent.
    agent_turns: int = 0

    def prompts_per_step(self, rollouts: int) -> int:
        return max(4, self.prompts_per_two_rollout_ranks * rollouts // 2)


# grpo-7b: a 7B GRPO step's shape on the published costs. Groups of 8 replies whose lengths reach 4,096 tokens
# (P(N >= n) = (48 / n) ** 0.8: a median of 114 tokens, a mean of about 390, about one group in 35 at the cap), so that
# a step's generation is held back by its longest groups and lasts most of the step, as in published profiles of
# synchronous GRPO (50-90% of a step generating). Half a prompt per rollout rank is played, each reply standing
# for 32: about 4 to 8 played replies per engine, 128 to 256 modelled (vLLM's usual max_num_seqs is 256), 192
# modelled prompts a step on 16 ranks. At pace 8 a modelled decode step of 6 played replies lasts 10 ms, ten
# times the real per-token overheads. short: the earlier default, replies of 2 to 128 tokens in groups of 4,
# each standing for itself; a step is shorter than a version's transfer, a regime no 7B run is in, kept for
# quick runs and the tests.
TIMING_WORKLOADS = {
    "grpo-7b": TimingWorkload("grpo-7b", "a 7B GRPO step's shape: groups of 8, replies of 48 to 4,096 tokens (tail "
                              "index 0.8), a prompt per two rollout ranks, each reply standing for 32 of the "
                              "modelled batch", group_size=8, prompts_per_two_rollout_ranks=1, min_count=48,
                              max_count=4096, alpha=0.8, speedup=8.0, batch_weight=32),
    "agent": TimingWorkload("agent", "a multi-turn agent program's episodes: three calls each, replies of 32 to 1,024 "
                            "tokens (tail index 0.8) and a tool result between them, groups of 8, a prompt per two "
                            "rollout ranks, each reply standing for 32", group_size=8,
                            prompts_per_two_rollout_ranks=1, min_count=32, max_count=1024, alpha=0.8, speedup=8.0,
                            batch_weight=32, agent_turns=3),
    "short": TimingWorkload("short", "short steps: groups of 4, replies of 2 to 128 tokens (tail index 0.8), two "
                            "prompts per rollout rank", group_size=4, prompts_per_two_rollout_ranks=4, min_count=2,
                            max_count=128, alpha=0.8, speedup=DEFAULT_SPEEDUP),
}
DEFAULT_WORKLOAD = "grpo-7b"
# A quarter of the ranks train by default. On the published costs a trainer H100 trains a 7B at about 5,700
# tokens/s and an L40S engine decodes about 2,500 tokens/s at batch 256, so a quarter training keeps an async run
# near the trainer's pace; a larger share (--timing-trainer-share) leaves it waiting for generation, where lending
# idle trainer ranks to rollout (seamless) has the most to give.
DEFAULT_TRAINER_SHARE = 0.25
# Statuses whose generated tokens were thrown away (never trained on).
DISCARDED_STATUSES = ("stale", "aborted", "failed")
STATE_COLOURS = {"generating": "tab:green", "training": "tab:blue", "syncing": "tab:orange", "lent": "tab:purple",
                 "waiting": "lightgray"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sfhpc bench pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="the small scale's recipe")
    p.add_argument("--scales", default=",".join(SCALES), help="comma-separated, from: " + ", ".join(SCALES))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--steps", type=int, default=8, help="training steps per run (the first is left out)")
    p.add_argument("--timing-steps", type=int, default=None, help="steps per timing-model run (default --steps)")
    p.add_argument("--ranks", type=int, default=16, help="ranks of the timing-model runs (16-64)")
    p.add_argument("--timing-workload", choices=tuple(TIMING_WORKLOADS), default=DEFAULT_WORKLOAD,
                   help="the timing scale's steps: " + "; ".join(f"{w.name}: {w.about} (pace {w.speedup:g})"
                                                              for w in TIMING_WORKLOADS.values()))
    p.add_argument("--timing-trainer-share", type=float, default=DEFAULT_TRAINER_SHARE, metavar="F",
                   help=f"the share of the timing scale's ranks that train (default {DEFAULT_TRAINER_SHARE:g}); "
                        "the rest but the controller generate")
    p.add_argument("--timing-speedup", type=float, default=None, metavar="K",
                   help="the timing scale models a machine K times as fast as its cost model: every modelled "
                        "duration divided by K (default: the workload's pace; 1: the cost model's own pace)")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate the timing scale on this invocation's small async run (default: the published "
                        "GPU figures of a 7B model, an L40S engine and an H100 trainer)")
    p.add_argument("--calibrate-from", type=Path, default=None, metavar="RUN_DIR",
                   help="an async run's folder to calibrate the timing scale on (default: published GPU figures)")
    p.add_argument("--sync-layout", choices=("disaggregated", "colocated"), default="disaggregated",
                   help="sync on the async run's roles, or every rank training and generating")
    p.add_argument("--weight-updates", choices=("staged", "paused"), default="staged",
                   help="the timing scale's weight updates: staged (engine.staged_updates: engines generate while a "
                        "version comes in, then pause to load it from a second copy in device memory) or paused "
                        "(engines pause for the transfer)")
    p.add_argument("--against-simulator", action="store_true",
                   help="also simulate each timing-scale mode on the same configuration (sfhpc.sim) and print the "
                        "controller's figures beside the simulator's (sfhpc.bench.crosscheck)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/pipeline.json"), help="JSON result file")
    args = p.parse_args(argv)
    args.modes = _choices(args.modes, MODES, "--modes")
    args.scales = _choices(args.scales, SCALES, "--scales")
    if args.steps < 2 or (args.timing_steps is not None and args.timing_steps < 2):
        raise SfhpcError("--steps must be at least 2 (the first step is left out)")
    if args.calibrate and "small" not in args.scales:
        raise SfhpcError("--calibrate calibrates on the small scale's async run: add small to --scales, or use "
                         "--calibrate-from RUN_DIR")
    if args.calibrate_from is not None and not RunPaths(args.calibrate_from).metrics.is_file():
        raise SfhpcError(f"--calibrate-from: {args.calibrate_from} is no run folder (it has no metrics.jsonl)")
    if args.timing_speedup is None:
        args.timing_speedup = TIMING_WORKLOADS[args.timing_workload].speedup
    if not 0 < args.timing_trainer_share < 1:
        raise SfhpcError(f"--timing-trainer-share must be between 0 and 1, found {args.timing_trainer_share:g}")
    if not args.timing_speedup > 0:
        raise SfhpcError(f"--timing-speedup must be more than 0, found {args.timing_speedup:g}")
    if args.against_simulator and "timing" not in args.scales:
        raise SfhpcError("--against-simulator compares the timing scale with the simulator: add timing to --scales")
    if args.ranks < MIN_TIMING_RANKS:
        raise SfhpcError(f"--ranks must be at least {MIN_TIMING_RANKS} (a controller, a trainer and two "
                         f"rollout ranks), found {args.ranks}")
    return args


def _choices(text: str, known: Sequence[str], option: str) -> list[str]:
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in known]
    if unknown or not chosen:
        raise SfhpcError(f"{option}: unknown value {unknown[0] if unknown else '(none)'!r}; choose from "
                         + ", ".join(known))
    return [m for m in known if m in chosen]  # in the order of the table


# -- the recipes ----------------------------------------------------------------------------------------
def role_ranks(role: Mapping[str, Any]) -> int:
    """Ranks a role of plain recipe data owns (0 when colocated, `tasks` when placed with another)."""
    if "colocate_with" in role:
        return 0
    if "place_with" in role:
        return int(role.get("tasks", 1))
    return int(role.get("nodes", 1)) * int(role.get("tasks_per_node", 1))


def recipe_for_mode(base: dict[str, Any], mode: str, steps: int, output_dir: Path,
                    sync_layout: str = "disaggregated") -> dict[str, Any]:
    """The base recipe (disaggregated, as loaded from YAML) for one mode and a short budget, on the same
    ranks: async as written, seamless with the trainer's nodes tagged rollout, sync on the same roles (or,
    `sync_layout` colocated, every rank training and generating)."""
    recipe = json.loads(json.dumps(base))  # a deep copy of plain YAML data
    recipe["name"] = f"{base.get('name', 'recipe')}-{mode}"
    recipe["output_dir"] = str(output_dir)
    budgets = recipe.setdefault("budgets", {})
    budgets["steps"] = steps
    budgets.pop("wall_minutes", None)
    recipe.setdefault("pipeline", {})["mode"] = mode
    roles = recipe.setdefault("roles", {})
    trainer, rollout = roles.setdefault("trainer", {}), roles.setdefault("rollout", {})
    if "colocate_with" in rollout:
        raise SfhpcError(f"the pipeline benchmark needs a disaggregated recipe (rollout on ranks of its own) to run "
                         f"async and seamless; {base.get('name')!r} colocates rollout with the trainer")
    if mode == "seamless" or (mode == "sync" and sync_layout == "colocated"):
        trainer["tags"] = sorted(set(trainer.get("tags", ["train"])) | {"rollout"})
    if mode == "sync" and sync_layout == "colocated":
        # The same ranks, every one of them training and generating.
        trainer.update(nodes=1, tasks_per_node=role_ranks(trainer) + role_ranks(rollout))
        roles["rollout"] = {"colocate_with": "trainer"}
    return recipe


def timing_recipe(ranks: int, costs: Any, *, model_path: str | None, seed: int = 0,
                  speedup: float = 1.0, staged: bool = True, workload: str = DEFAULT_WORKLOAD,
                  trainer_share: float = DEFAULT_TRAINER_SHARE) -> dict[str, Any]:
    """The timing scale on `ranks` ranks: `workload`'s steps (`TIMING_WORKLOADS`: the long-tailed
    ``repeat-letter`` task), test engines and a trainer that are timing models of `costs` (a `CostModel` with
    one GPU type for engines and trainers alike), every modelled duration divided by `speedup` (a machine that
    many times as fast: the modes' ratios stay, while the real overheads stay small beside the modelled
    times). `trainer_share` of the ranks train (at least one), the rest but the controller generate (at least
    two). A version takes the modelled broadcast on the network; with `staged` (``engine.staged_updates``) the
    engines generate meanwhile and pause only to load it from a second copy in device memory
    (`CostModel.staged_load_s`), else they pause for the transfer."""
    from sfhpc.tasks.long_tail import RepeatLetterTask

    shape = TIMING_WORKLOADS[workload]
    weight = shape.batch_weight
    turns = max(1, shape.agent_turns)
    trainers = min(ranks - 3, max(1, int((ranks - 1) * trainer_share)))
    rollouts = ranks - 1 - trainers
    gpu, device = next(iter(costs.devices.items()))
    options: dict[str, Any] = {"min_count": shape.min_count, "max_count": shape.max_count, "alpha": shape.alpha}
    recipe: dict[str, Any] = {
        "name": f"bench-timing-{ranks}",
        "seed": seed,
        # The prompt, the longest replies of every turn, their slack and the tool results between them.
        "model": {"max_seq_len": turns * (shape.max_count + 32) + 128},
        "algorithm": {"name": "grpo", "group_size": shape.group_size},
        "pipeline": {"mode": "async", "max_staleness": 1},
        "budgets": {"steps": 8, "prompts_per_step": shape.prompts_per_step(rollouts),
                    "max_new_tokens": RepeatLetterTask(**options).max_reply_tokens},  # the count and its slack
        "task": {"name": "repeat-letter", "options": options},
        "engine": {"name": "test", "writes_to_budget": True, "staged_updates": staged,
                   "token_delay_s": round(device.decode_base_s / speedup, 6)},
        "timing_model": {"per_sequence_s": round(device.decode_per_sequence_s * weight / speedup, 7),
                         "prefill_per_token_s": round(device.prefill_per_token_s * weight / speedup, 8),
                         "weight_transfer_s": round(costs.weight_sync_s(rollouts) / speedup, 4),
                         "weight_load_s": round(costs.staged_load_s(gpu) / speedup, 5) if staged else 0.0,
                         "train_per_token_s": round(device.train_per_token_s * weight / speedup, 8)},
        "training": {"backend": "timing"},
        "roles": {"controller": {"place_with": "trainer"},
                  "trainer": {"tags": ["train"], "nodes": 1, "tasks_per_node": trainers},
                  "rollout": {"tags": ["rollout"], "nodes": 1, "tasks_per_node": rollouts}},
    }
    if shape.agent_turns:
        from sfhpc.bench import timing_agent

        # Enough programs per rank for the episodes in flight (two steps' worth, at most staleness 1).
        recipe["agent"] = {"command": [sys.executable, timing_agent.__file__, str(shape.agent_turns),
                                       str(shape.min_count), str(shape.max_count), str(shape.alpha)],
                           "serve": True, "timeout_s": 3600,
                           "workers": max(4, 2 * shape.prompts_per_step(rollouts) * shape.group_size // rollouts)}
    if model_path is not None:
        recipe["model"]["path"] = model_path
    return recipe


def timing_costs(calibration: dict[str, Any] | None) -> Any:
    """The cost model of the timing scale: calibrated on the small scale's async run when there is one."""
    from sfhpc.sim.cost_model import CostModel

    if calibration is None:
        published = CostModel.published("qwen2.5-7b", ("h100", "l40s"))
        # One GPU type per run here: engines decode at the L40S's pace, the trainer trains at the H100's.
        engine, trainer = published.device("l40s"), published.device("h100")
        import dataclasses

        device = dataclasses.replace(engine, train_per_token_s=trainer.train_per_token_s)
        return dataclasses.replace(published, devices={"gpu": device},
                                   source=published.source + " (engines L40S, trainer H100)")
    return CostModel.calibrated_from(calibration["rows"], trainer_gpus=calibration["trainers"],
                                     rollout_engines=calibration["engines"], concurrency=calibration["concurrency"],
                                     weight_bytes=calibration["weight_bytes"])


# -- one run ----------------------------------------------------------------------------------------------
def run_mode(recipe_data: dict[str, Any], path: Path) -> dict[str, Any]:
    """Write `recipe_data` to `path`, run it on this machine and measure it. A mode this version refuses
    before a job starts comes back as ``{"available": False, "reason": ...}``."""
    from sfhpc.config import load_recipe
    from sfhpc.launch.local import run_local
    from sfhpc.plan.local_map import local_cluster_map
    from sfhpc.plan.resolve import resolve
    from sfhpc.rl.program import check_runnable
    from sfhpc.rundir import new_run_dir

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe_data, sort_keys=False))
    recipe = load_recipe(str(path))
    mode = recipe.pipeline.mode
    try:
        check_runnable(recipe)
    except SfhpcError as exc:
        if mode != "seamless":
            raise
        return {"available": False, "reason": str(exc).split(": ", 2)[-1]}
    plan = resolve(recipe, local_cluster_map(recipe))
    run_dir = new_run_dir(recipe.output_dir, recipe.name)
    log = path.with_suffix(".log")
    print(f"== {recipe.name}: {plan.world_size} ranks, {recipe.budgets.steps} steps; run folder {run_dir}, "
          f"log {log}", flush=True)
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as output:
        code = run_local(plan, str(path), None, run_dir, output=output)
    wall_s = time.monotonic() - started
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-5:]).strip()
        raise SfhpcError(f"the {mode} run of {recipe.name} failed (exit {code}); its log is {log}: {tail[-400:]}")
    metrics = read_log(RunPaths(run_dir).metrics)
    figures = {"available": True, "run_dir": str(run_dir), "ranks": plan.world_size, "wall_s": wall_s,
               "trainer_ranks": sum("trainer" in s.roles for s in plan.ranks()),
               "rollout_ranks": sum("rollout" in s.roles for s in plan.ranks()), **summarize(metrics)}
    figures.update(store_figures(run_dir))
    events = read_log(RunPaths(run_dir).events)
    figures["events"] = [e.get("event") for e in events]
    figures.update(move_figures(events))
    figures["ran_as"] = next((e["mode"] for e in events if e.get("event") == "pipeline"), mode)
    return figures


def move_figures(events: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Episodes moved at reclaims and rebalancing (``moved``), of them agent programs' moved by their generations
    (``routed``), and those continued from their prefix (``continued``), from the run's event log."""
    moves = [e for e in events if e.get("event") in ("reclaimed", "rebalanced")]
    return {key: sum(int(e.get(key, 0)) for e in moves) for key in ("moved", "routed", "continued")}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput, the split of the controller's step time, staleness and lending, over the steps after the
    first (engine warm-up)."""
    steady = rows[1:]
    step_s = sum(r["step_s"] for r in steady)
    train_s = sum(r["train_s"] for r in steady)
    sync_s = sum(r["sync_s"] for r in steady)
    trained = sum(r["trained_tokens"] for r in steady)
    generated = sum(r["generated_tokens"] for r in steady)
    weights = [r["generated_tokens"] for r in steady]
    stale = [r.get("mean_staleness", 0.0) for r in steady]
    reclaims = [r["reclaim_s"] for r in steady if r.get("reclaim_s")]
    last = rows[-1] if rows else {}
    return {"steps": len(steady), "step_seconds": step_s,
            "median_step_s": statistics.median(r["step_s"] for r in steady),
            "trained_tokens": trained, "generated_tokens": generated,
            "trained_tokens_per_s": trained / step_s, "generated_tokens_per_s": generated / step_s,
            "wait_share": max(0.0, step_s - train_s - sync_s) / step_s, "train_share": train_s / step_s,
            "sync_share": sync_s / step_s, "reward_first": rows[0]["reward_mean"],
            "reward_last": rows[-1]["reward_mean"],
            "mean_staleness": sum(w * s for w, s in zip(weights, stale)) / max(sum(weights), 1),
            "max_staleness": max(r.get("max_staleness", 0) for r in rows),
            "lends": int(last.get("lends", 0)), "reclaims": int(last.get("reclaims", 0)),
            "reclaim_latency_mean_s": statistics.mean(reclaims) if reclaims else None,
            "reclaim_latency_max_s": max(reclaims) if reclaims else None}


def discarded_tokens(statuses: Sequence[str], generated: Sequence[int], segment_kinds: Sequence[str],
                     segment_tokens: Sequence[int], segment_used: Sequence[int],
                     segment_discarded_status: Sequence[bool]) -> int:
    """Policy-generated tokens never to be trained on: every generated token of a stale, aborted or failed
    trajectory, and in the others the generated segments' tokens off the trajectory's branch (a cut
    generation that was not continued from its prefix). `segment_discarded_status` marks the segments of
    trajectories already counted whole."""
    whole = sum(int(g) for s, g in zip(statuses, generated) if s in DISCARDED_STATUSES)
    off_branch = sum(int(t) - int(u) for k, t, u, d in zip(segment_kinds, segment_tokens, segment_used,
                                                            segment_discarded_status)
                     if k == "generated" and not d)
    return whole + off_branch


def store_figures(run_dir: Path) -> dict[str, Any]:
    """Tokens discarded, and the bubble fraction and intervals of the run's timeline (when the store has one)."""
    from sfhpc.analysis import open_run

    figures: dict[str, Any] = {}
    with open_run(run_dir) as run:
        trajectories = run.trajectories()
        segments = run.segments()
        status_of = dict(zip(trajectories["id"], trajectories["status"]))
        dropped = [status_of.get(t) in DISCARDED_STATUSES for t in segments["trajectory"]]
        figures["tokens_discarded"] = discarded_tokens(
            list(trajectories["status"]), list(trajectories["generated_tokens"]), list(segments["kind"]),
            list(segments["tokens"]), list(segments["used"]), dropped)
        figures["trajectories_by_status"] = {str(k): int(v) for k, v in trajectories["status"].value_counts().items()}
        figures["timeline"] = after_first_step(timeline_rows(run_dir))
    if figures["timeline"]:
        from sfhpc.data.rank_intervals import bubble_fraction

        rows = figures["timeline"]
        bubble = bubble_fraction([r["role"] for r in rows], [r["state"] for r in rows], [r["t_start"] for r in rows],
                                 [r["t_end"] for r in rows])
        figures["bubble"] = bubble.as_dict()
        figures["bubble_text"] = bubble.format()
    else:
        figures["bubble"] = None
        figures["bubble_text"] = "not recorded"
    figures["engine_pause_s"] = engine_pause_s(figures["timeline"])
    return figures


def engine_pause_s(timeline: Sequence[Mapping[str, Any]]) -> float | None:
    """How long a weight update paused a rollout rank's engine: the median of the rollout ranks' ``syncing``
    intervals (one per rank and update; None without a timeline)."""
    pauses = [r["t_end"] - r["t_start"] for r in timeline if r["role"] == "rollout" and r["state"] == "syncing"]
    return statistics.median(pauses) if pauses else None


def after_first_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timeline from the end of the first training step on, intervals clipped there: like the step
    figures, it leaves out the start-up (ranks coming up while the first episodes were handed out)."""
    ends = [r["t_end"] for r in rows if r["state"] == "training"]
    if not ends:
        return rows
    cutoff = min(ends)
    return [{**r, "t_start": max(r["t_start"], cutoff)} for r in rows if r["t_end"] > cutoff]


def timeline_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The store's timeline table as plain rows (empty for a store without one)."""
    from sfhpc.data import open_store

    with open_store(RunPaths(run_dir).store) as store:
        try:
            rows = store.table("timeline")
        except KeyError:
            return []
        return [{"rank": int(r["rank"]), "role": _text(r["role"]), "state": _text(r["state"]),
                 "t_start": float(r["t_start"]), "t_end": float(r["t_end"]), "step": int(r["step"])} for r in rows]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- output ---------------------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.1f}%"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _by_role(by_role: Mapping[str, float | None]) -> str:
    return ", ".join(f"{role} {_pct(value)}" for role, value in by_role.items()) or "-"


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        if not r.get("available", True):
            rows.append([r["scale"], r["mode"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                         "not available"])
            continue
        sync = next((s for s in results if s["scale"] == r["scale"] and s["mode"] == "sync" and s.get("available")),
                    None)
        ratio = f"{r['trained_tokens_per_s'] / sync['trained_tokens_per_s']:.2f}x" if sync else "-"
        bubble = r.get("bubble") or {}
        ran_as = "" if r.get("ran_as", r["mode"]) == r["mode"] else f" (as {r['ran_as']})"
        rows.append([r["scale"], r["mode"] + ran_as,
                     str(r["ranks"]), str(r["steps"]), f"{r['trained_tokens_per_s']:,.0f}", ratio,
                     _pct(bubble.get("overall")), _by_role(bubble.get("by_role") or {}),
                     _secs(r.get("engine_pause_s")),
                     f"{r['tokens_discarded']:,}", f"{r['mean_staleness']:.2f}/{r['max_staleness']}",
                     f"{r['lends']}/{r['reclaims']}",
                     f"{_secs(r['reclaim_latency_mean_s'])}/{_secs(r['reclaim_latency_max_s'])}", f"{r['wall_s']:.0f}"])
    return format_table(["scale", "mode", "ranks", "steps", "trained tok/s", "vs sync", "bubble", "bubble by role",
                         "pause/update s", "discarded tok", "staleness mean/max", "lends/reclaims",
                         "reclaim s mean/max", "wall s"], rows)


def write_run_trace(run_dir: Path, out: Path) -> Path | None:
    """The run's timeline as a Chrome trace (`sfhpc.analysis.trace`), to zoom into one step of one rank;
    None when its store keeps no timeline."""
    from sfhpc.analysis import open_run
    from sfhpc.analysis.trace import run_trace

    with open_run(run_dir) as run:
        timeline = run.timeline()
        if not len(timeline):
            return None
        out.write_text(json.dumps(run_trace(run_dir, timeline)), encoding="utf-8")
    return out


def timeline_chart(result: dict[str, Any], out: Path) -> Path | None:
    """Every rank's states over time (one row per rank), or the controller's step phases without a timeline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result.get("timeline") or []
    title = (f"{result['scale']} scale, {result['mode']}: {result['trained_tokens_per_s']:,.0f} trained tok/s, "
             f"bubble {_pct((result.get('bubble') or {}).get('overall'))}")
    if result["scale"] == "timing":
        title += " (compute modelled)"
    ranks = sorted({r["rank"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.22 * max(len(ranks), 3)))
    if rows:
        t0 = min(r["t_start"] for r in rows)
        for row, rank in enumerate(ranks):
            for state, colour in STATE_COLOURS.items():
                spans = [(r["t_start"] - t0, r["t_end"] - r["t_start"]) for r in rows
                         if r["rank"] == rank and r["state"] == state]
                if spans:
                    ax.broken_barh(spans, (row - 0.4, 0.8), color=colour, label=state if row == 0 else None)
        ax.set_yticks(range(len(ranks)))
        roles = {r["rank"]: r["role"] for r in rows}
        ax.set_yticklabels([f"{rank} {roles[rank]}" for rank in ranks], fontsize=6)
        ax.set_xlabel("seconds since the first recorded interval")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLOURS.values()]
        ax.legend(handles, list(STATE_COLOURS), loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=7)
    else:
        ax.text(0.5, 0.5, "no timeline recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def throughput_chart(results: list[dict[str, Any]], out: Path) -> Path | None:
    """Trained tokens/s per mode, one panel per scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    scales = [s for s in SCALES if any(r["scale"] == s for r in results)]
    fig, axes = plt.subplots(1, len(scales), figsize=(4.5 * len(scales), 3), squeeze=False)
    for ax, scale in zip(axes[0], scales):
        mine = [r for r in results if r["scale"] == scale and r.get("available", True)]
        ax.bar([r["mode"] for r in mine], [r["trained_tokens_per_s"] for r in mine],
               color=["tab:gray", "tab:blue", "tab:purple"][: len(mine)])
        ax.set_title(f"{scale} scale" + (" (compute modelled)" if scale == "timing" else " (measured)"), fontsize=9)
        ax.set_ylabel("trained tokens/s")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def calibration_of(run_dir: Path, model_dir: Path | None) -> dict[str, Any]:
    """What `timing_costs` calibrates on from an async run's folder: its metrics, how many ranks trained and
    generated (its launch report), how many episodes each engine held (two steps' worth: async with
    ``max_staleness`` 1) and the bytes of its weights."""
    rows = read_log(RunPaths(run_dir).metrics)
    ranks = json.loads(RunPaths(run_dir).launch_report.read_text())["ranks"]
    trainers = sum("trainer" in r["roles"] for r in ranks)
    engines = sum("rollout" in r["roles"] for r in ranks)
    per_step = statistics.median(r["trajectories"] for r in rows)
    model_dir = model_dir if model_dir is not None else RunPaths(run_dir).model
    return {"rows": rows, "trainers": trainers, "engines": engines,
            "concurrency": max(1, int(2 * per_step) // max(engines, 1)), "weight_bytes": weight_bytes(model_dir)}


def weight_bytes(model_dir: Path) -> float:
    """Bytes of the engines' weights in a model folder (safetensors files)."""
    return float(sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))) or 1.0


def against_simulator(timing: list[dict[str, Any]], base: dict[str, Any], costs: Any,
                      args: argparse.Namespace) -> dict[str, Any]:
    """The timing scale's modes simulated on the same configuration, beside the controller's figures."""
    from sfhpc.bench import crosscheck

    modes = [m for m in args.modes if m != "sync" or args.sync_layout == "colocated"]
    left_out = "" if modes == list(args.modes) else ("sync is not compared: the simulator's sync is colocated "
                                                     "(run with --sync-layout colocated)")
    measured = next((r for r in timing if r.get("available", True)), None)
    if measured is None:
        return {"rows": [], "text": "no timing-scale run to compare"}
    shape = crosscheck.episode_shape_of(RunPaths(Path(measured["run_dir"])).store)
    workload = TIMING_WORKLOADS[args.timing_workload]
    simulated = crosscheck.simulate_modes(base, costs, args.timing_speedup, modes, args.timing_steps or args.steps,
                                          shape, batch_weight=workload.batch_weight,
                                          turns=max(1, workload.agent_turns))
    rows = crosscheck.compare(timing, simulated)
    return {"rows": [r.as_json() for r in rows], "same_order": crosscheck.same_order(rows),
            "prompt_tokens": shape.prompt_tokens, "observation_tokens": shape.observation_tokens,
            "turnaround_s": shape.turnaround_s, "text": crosscheck.format_comparison(rows, left_out)}


# -- the benchmark -----------------------------------------------------------------------------------------
def run_scale(scale: str, base: dict[str, Any], modes: Sequence[str], steps: int, bench_dir: Path,
              modelled: str, sync_layout: str = "disaggregated") -> list[dict[str, Any]]:
    """Every mode of one scale. The model the first run builds (and warm-starts) is every later run's
    ``model.path``: each mode starts from the same policy, and the build is paid once."""
    base = json.loads(json.dumps(base))
    results = []
    for mode in modes:
        data = recipe_for_mode(base, mode, steps, bench_dir / scale, sync_layout)
        figures = run_mode(data, bench_dir / scale / f"{data['name']}.yaml")
        result = {"scale": scale, "mode": mode, "modelled": modelled, **figures}
        if not figures["available"]:
            print(f"{scale} scale, seamless: not available ({figures['reason']})", flush=True)
        model = base.setdefault("model", {})
        if figures["available"] and not model.get("path"):
            model["path"] = str(RunPaths(Path(figures["run_dir"]).resolve()).model)
            model.pop("build", None)  # the built model's shape and warm start: refused beside a path
        result["model"] = model.get("path")
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bench_dir = args.out.parent / "pipeline"
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    notes: dict[str, str] = {}
    calibration = None
    crosschecked: dict[str, Any] | None = None
    transfer_s = 0.0  # the timing scale's modelled transfer of a version
    model_path: str | None = None
    if "small" in args.scales:
        base = read_recipe_mapping(args.recipe)
        notes["small"] = ("measured: real vLLM engines, real torch training, MPI, the trajectory manager and store "
                          f"(recipe {args.recipe})")
        print(f"small scale: {notes['small']}", flush=True)
        small = run_scale("small", base, args.modes, args.steps, bench_dir, modelled="nothing",
                          sync_layout=args.sync_layout)
        results += small
        calibrating = next((r for r in small if r["mode"] == "async" and r.get("available")), None)
        if calibrating is not None and args.calibrate and args.calibrate_from is None:
            calibration = calibration_of(Path(calibrating["run_dir"]), Path(calibrating["model"]))
            model_path = calibrating["model"]
    if args.calibrate_from is not None:
        calibration = calibration_of(args.calibrate_from, None)
    if "timing" in args.scales:
        costs = timing_costs(calibration)
        base = timing_recipe(args.ranks, costs, model_path=model_path, speedup=args.timing_speedup,
                             staged=args.weight_updates == "staged", workload=args.timing_workload,
                             trainer_share=args.timing_trainer_share)
        transfer_s = float(base["timing_model"]["weight_transfer_s"])
        pace = "" if args.timing_speedup == 1 else f", every duration divided by {args.timing_speedup:g}"
        updates = "staged" if args.weight_updates == "staged" else "paused for the transfer"
        notes["timing"] = ("modelled: engine decode/prefill/weight-load times, the weights' network (updates "
                           f"{updates}) and trainer step times (timing-model test engine and 'timing' trainer "
                           f"backend; {costs.source}{pace}); real: the scheduler, trajectory manager, store, agents, "
                           "endpoint, weight broadcast and MPI")
        notes["timing"] += f"; workload {args.timing_workload}: {TIMING_WORKLOADS[args.timing_workload].about}"
        print(f"timing scale, {args.ranks} ranks: {notes['timing']}\n{costs.describe()}", flush=True)
        timing = run_scale("timing", base, args.modes, args.timing_steps or args.steps, bench_dir,
                           modelled=notes["timing"], sync_layout=args.sync_layout)
        results += timing
        if args.against_simulator:
            crosschecked = against_simulator(timing, base, costs, args)
    elapsed = time.monotonic() - started
    print(f"pipeline benchmark, {args.steps} steps per run (the first left out), long-tailed workload "
          f"(repeat-letter), sync {args.sync_layout}, {elapsed:.0f} s in all")
    print(table(results))
    for scale, note in notes.items():
        print(f"{scale}: {note}")
    if transfer_s:
        for r in results:
            if r["scale"] == "timing" and r.get("engine_pause_s") is not None:
                print(f"timing {r['mode']}: a weight update paused each engine {r['engine_pause_s']:.3f} s (median), "
                      f"{r['engine_pause_s'] / transfer_s:.0%} of the modelled transfer ({transfer_s:.3f} s)")
    for r in results:
        if r.get("routed"):
            aborted = (r.get("trajectories_by_status") or {}).get("aborted", 0)
            print(f"{r['scale']} {r['mode']}: {r['routed']} agent programs' episodes moved by their generations, "
                  f"continued from their prefix; {aborted} trajectories aborted (played afresh)")
    if crosschecked is not None:
        print(f"timing scale against the simulator, the same configuration:\n{crosschecked['text']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    charts = []
    for r in results:
        if r.get("available", True):
            chart = timeline_chart(r, args.out.with_name(f"{args.out.stem}-{r['scale']}-{r['mode']}.png"))
            if chart is not None:
                charts.append(str(chart))
                r["chart"] = str(chart)
            trace = write_run_trace(Path(r["run_dir"]), args.out.with_name(f"{args.out.stem}-{r['scale']}-{r['mode']}"
                                                                             ".trace.json"))
            if trace is not None:
                charts.append(str(trace))
                r["trace"] = str(trace)
    summary_chart = throughput_chart(results, args.out.with_suffix(".png"))
    if summary_chart is not None:
        charts.append(str(summary_chart))
    args.out.write_text(json.dumps({"bench": "pipeline", "recipe": str(args.recipe), "steps": args.steps,
                                    "sync_layout": args.sync_layout, "timing_speedup": args.timing_speedup,
                                    "timing_workload": args.timing_workload,
                                    "timing_trainer_share": args.timing_trainer_share,
                                    "ranks": args.ranks, "seconds": elapsed, "modelled": notes,
                                    "results": results, "against_simulator": crosschecked}, indent=2) + "\n")
    print(f"wrote {args.out}")
    if charts:
        print("charts: " + ", ".join(charts))
    return 0


if __name__ == "__main__":
    run_as_script(main)
