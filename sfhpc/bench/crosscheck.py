"""The timing scale and the simulator on one configuration: is the simulator's claim the controller's?

    sfhpc bench pipeline --scales timing --against-simulator [--ranks 16] [--timing-speedup 3]

The timing scale runs the real controller, scheduler, trajectory manager, store, endpoint and MPI with
compute modelled (`sfhpc.bench.pipeline`); the simulator (`sfhpc.sim`) runs the same `Scheduler` and
`PipelinePolicy` on a discrete-event clock with the same compute model. Both are given one configuration
here: the timing recipe's ranks (its trainer ranks as trainer GPUs, its rollout ranks as rollout GPUs; the
controller holds none), its costs divided by the same speedup, its workload (``repeat-letter``'s long tail of
reply lengths, one length per group as the test engine writes each reply to its budget, the prompts' length
as the runs measured it; with an agent program, its calls, each reply drawn for itself, the tool results'
length and the program's turnaround between calls as the runs measured them, and every call prefilling its
whole context, as the test engine keeps none), its batch, staleness bound and rebalancing, and the same steps
with the first left out. Moves are charged as the code makes them: a cut generation continues from its prefix
on another engine, prefilled there (an agent program's episode by its generations, the program staying
where it is), and a weight update cuts every running generation, which continues from its prefix under the
new weights. The lending costs are the timing scale's: none (its trainer ranks' engines are up from the start and
its trainer keeps its state in place), so the simulator charges none either.

Per mode: trained tokens/s, bubble and the share of rollout time spent in weight updates (the engine's
pause), side by side, with the ratio of the controller's throughput to the simulator's. Where the ratio
leaves ``[1 - TOLERANCE, 1 + TOLERANCE]`` or the modes rank differently, the simulator models something the
code does not do (or the reverse), and the table says which mode.

``sync`` is compared only with ``--sync-layout colocated`` (the simulator's sync generates and trains on
every GPU); with the disaggregated layout it is left out and the table says so.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sfhpc.config.cluster import Pool
from sfhpc.sim.cluster import SimCluster
from sfhpc.sim.cost_model import CostModel
from sfhpc.sim.pipeline import SimConfig, SimResult, simulate
from sfhpc.sim.workload import Workload
from sfhpc.table import format_table

TOLERANCE = 0.15  # the simulator within 15% of the controller's trained tokens/s, per mode
GPU = "gpu"  # the timing scale's one GPU type (engines and trainer alike)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One mode measured on the timing scale and simulated on the same configuration."""

    mode: str
    timing_tokens_per_s: float
    sim_tokens_per_s: float
    timing_bubble: float | None
    sim_bubble: float | None
    timing_pause_share: float | None  # rollout rank-seconds in weight updates / all rollout rank-seconds
    sim_pause_share: float | None

    @property
    def ratio(self) -> float:
        """The controller's trained tokens/s over the simulator's."""
        return self.timing_tokens_per_s / self.sim_tokens_per_s if self.sim_tokens_per_s else float("inf")

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": self.ratio, "within": self.within}


@dataclasses.dataclass(frozen=True)
class EpisodeShape:
    """What a run's episodes held beside their replies, as its store recorded them."""

    prompt_tokens: int
    observation_tokens: int = 0  # a tool result between two calls of an agent program, with its template
    turnaround_s: float = 0.0    # from a reply's end to the program's next call


def episode_shape_of(store: Path) -> EpisodeShape:
    """The mean prompt, the mean observation between calls and the program's mean turnaround of a run's
    trajectories (its store)."""
    from sfhpc.data.store_reader import open_store
    from sfhpc.data.trajectory import SegmentKind

    prompts, observations, turnarounds = [], [], []
    with open_store(store) as reader:
        for trajectory in reader.trajectories():
            segments = trajectory.segments
            prompts.append(len(segments[0]))
            for segment in segments[1:]:
                if segment.kind is SegmentKind.OBSERVATION:
                    observations.append(len(segment))
                    turnarounds.append(max(0.0, segment.t_start - segments[segment.parent].t_end))
    return EpisodeShape(max(1, round(statistics.fmean(prompts))) if prompts else 1,
                        round(statistics.fmean(observations)) if observations else 0,
                        statistics.fmean(turnarounds) if turnarounds else 0.0)


def timing_workload(recipe: Mapping[str, Any], shape: EpisodeShape, turns: int = 1) -> Workload:
    """The timing recipe's ``repeat-letter`` task as the simulator's workload: a reply is the asked count
    plus the task's slack (the test engine writes each to its budget), the same for a whole group. With
    `turns` > 1, the timing scale's agent program (`sfhpc.bench.timing_agent`): that many calls, each reply
    drawn for itself from the same tail, the measured tool result and turnaround between them, and every
    call prefilling its whole context (the test engine keeps nothing between requests)."""
    from sfhpc.tasks.long_tail import RepeatLetterTask

    task = RepeatLetterTask(**recipe["task"].get("options", {}))  # the task's own defaults where the recipe has none
    group = int(recipe["algorithm"]["group_size"])
    cap = int(recipe["budgets"]["max_new_tokens"])
    if turns > 1:
        return Workload("timing-scale agent", group_size=group, prompt_tokens=shape.prompt_tokens,
                        reply_min=task.min_count, reply_max=task.max_count, reply_alpha=task.alpha,
                        turns_min=turns, turns_max=turns, observation_tokens=shape.observation_tokens,
                        env_s=shape.turnaround_s, reply_cap=cap, prefix_cache=False)
    return Workload("timing-scale", group_size=group, prompt_tokens=shape.prompt_tokens,
                    reply_min=task.min_count, reply_max=task.max_count, reply_alpha=task.alpha,
                    reply_slack=task.slack, reply_cap=cap, group_lengths=True, prefix_cache=False)


def timing_cluster(recipe: Mapping[str, Any]) -> SimCluster:
    """The timing recipe's trainer and rollout ranks as one GPU each; the trainer's pool tagged rollout, so
    that the simulator lends it in ``seamless`` (the timing scale's seamless recipe tags it so)."""
    from sfhpc.bench.pipeline import role_ranks

    trainers, rollouts = role_ranks(recipe["roles"]["trainer"]), role_ranks(recipe["roles"]["rollout"])

    def pool(name: str, tags: tuple[str, ...], gpus: int) -> Pool:
        return Pool(name=name, partition=name, nodes=1, tags=tags, cpus_per_node=gpus, memory_mb=gpus * 1024,
                    gpus_per_node=gpus, gpu_type=GPU)

    return SimCluster("timing-scale", pool("trainer", ("train", "rollout"), trainers),
                      pool("rollout", ("rollout",), rollouts))


def timing_cost_model(costs: CostModel, speedup: float, batch_weight: float = 1.0) -> CostModel:
    """`costs` at the timing scale's pace (every duration divided by `speedup`), without lending costs; each
    sequence costing what `batch_weight` of them cost (`sfhpc.bench.pipeline.TimingWorkload.batch_weight`)."""
    device = costs.device(GPU)
    fast = dataclasses.replace(device, decode_base_s=device.decode_base_s / speedup,
                               decode_per_sequence_s=device.decode_per_sequence_s * batch_weight / speedup,
                               prefill_per_token_s=device.prefill_per_token_s * batch_weight / speedup,
                               train_per_token_s=device.train_per_token_s * batch_weight / speedup)
    fast = dataclasses.replace(fast, host_gb_s=float("inf"))  # an engine's wake-up: free at the timing scale
    return dataclasses.replace(costs, devices={GPU: fast}, sync_gb_s=costs.sync_gb_s * speedup, engine_fixed_s=0.0,
                               trainer_state_bytes=0.0)


def simulate_modes(recipe: Mapping[str, Any], costs: CostModel, speedup: float, modes: Sequence[str], steps: int,
                   shape: EpisodeShape, batch_weight: float = 1.0, turns: int = 1) -> dict[str, SimResult]:
    """Each of `modes` simulated on the timing recipe's configuration."""
    cluster, cost, workload = timing_cluster(recipe), timing_cost_model(costs, speedup, batch_weight), \
        timing_workload(recipe, shape, turns)
    pipeline = recipe.get("pipeline", {})
    return {mode: simulate(cluster, cost, SimConfig(mode=mode, workload=workload,
                                                    prompts_per_step=int(recipe["budgets"]["prompts_per_step"]),
                                                    steps=steps, warmup_steps=1,
                                                    max_staleness=int(pipeline.get("max_staleness", 1)),
                                                    max_token_lag=pipeline.get("max_token_lag"),
                                                    seed=int(recipe.get("seed", 0)),
                                                    rebalance=bool(pipeline.get("rebalance", True)),
                                                    staged_updates=bool(recipe.get("engine", {}).get(
                                                        "staged_updates", False))))
            for mode in modes}


def pause_share(timeline: Sequence[Mapping[str, Any]]) -> float | None:
    """Rollout rank-seconds in weight updates over all rollout rank-seconds, from a run's timeline rows."""
    rollout = [r for r in timeline if r["role"] == "rollout"]
    total = sum(r["t_end"] - r["t_start"] for r in rollout)
    syncing = sum(r["t_end"] - r["t_start"] for r in rollout if r["state"] == "syncing")
    return syncing / total if total > 0 else None


def compare(timing: Sequence[Mapping[str, Any]], simulated: Mapping[str, SimResult]) -> list[Comparison]:
    """The timing scale's results (one per mode, as `sfhpc.bench.pipeline.run_mode` returns them) beside the
    simulator's."""
    rows = []
    for result in timing:
        sim = simulated.get(result["mode"])
        if sim is None or not result.get("available", True):
            continue
        bubble = (result.get("bubble") or {}).get("overall")
        rows.append(Comparison(result["mode"], float(result["trained_tokens_per_s"]), sim.trained_tokens_per_s,
                               bubble, sim.bubble.get("all"), pause_share(result.get("timeline") or []),
                               sim.shares.get("rollout", {}).get("syncing")))
    return rows


def same_order(rows: Sequence[Comparison]) -> bool:
    """Whether the controller and the simulator rank the modes alike by trained tokens/s."""
    by_timing = [r.mode for r in sorted(rows, key=lambda r: r.timing_tokens_per_s)]
    by_sim = [r.mode for r in sorted(rows, key=lambda r: r.sim_tokens_per_s)]
    return by_timing == by_sim


def format_comparison(rows: Sequence[Comparison], left_out: str = "") -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    table = format_table(["mode", "controller tok/s", "simulator tok/s", "ratio", "bubble (ctl/sim)",
                          "engine pause (ctl/sim)", f"within {TOLERANCE:.0%}"],
                         [[r.mode, f"{r.timing_tokens_per_s:,.0f}", f"{r.sim_tokens_per_s:,.0f}", f"{r.ratio:.2f}",
                           f"{pct(r.timing_bubble)} / {pct(r.sim_bubble)}",
                           f"{pct(r.timing_pause_share)} / {pct(r.sim_pause_share)}", "yes" if r.within else "NO"]
                          for r in rows])
    order = "the same order of modes" if same_order(rows) else "a DIFFERENT order of modes"
    lines = [table, f"controller and simulator give {order}"]
    if left_out:
        lines.append(left_out)
    return "\n".join(lines)
