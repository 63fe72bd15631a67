"""The RL loop of the controller on a simulated clock, per pipeline mode, and the figures it measures.

The loop is the controller's (`sfhpc.rl.controller.run_loop`): hand out episodes as the pipeline policy
admits them, wait for the oldest complete, trainable groups, train, bring every engine to the new weights.
What to admit, what is too stale, when to lend, reclaim and rebalance is the controller's own
`PipelinePolicy` (`sfhpc.rl.pipeline_policy`): nothing of it is written twice. The `Scheduler` is the real
one, built from the plan of a scaled tag map: it picks the least loaded engine for every episode, owns every
rank's state, and in ``seamless`` lends and reclaims the trainer's ranks. What is modelled is compute only: how long
decoding, prefill, a training step, a weight broadcast and a lend or reclaim take (`CostModel`).

Modes:

* ``sync``: generate-then-train on every GPU. The trainer's GPUs hold engines too (colocated): after the
  batch they put the engine to sleep and load the trainer (the reclaim cost), after the weight update
  they wake it again (the lend cost). The rollout GPUs wait while the trainer trains.
* ``async``: the trainer's GPUs only train; rollout GPUs keep generating; a weight update pauses the
  engines for the transfer (with `SimConfig.staged_updates`: they generate during the transfer and pause only to
  load the version from a second copy in device memory) and interrupted generations continue with the new
  weights from their prefix, prefilled again (partial rollout, as the engines of a run continue them). A group
  is dropped (its tokens discarded) only under `SimConfig.max_token_lag`, as in a run.
* ``seamless``: ``async``, and while the trainer waits for its batch the scheduler lends the trainer's
  ranks (their pool tagged ``rollout``) to rollout. With `SimConfig.rebalance` (the default, as in a run) a
  lent rank with nothing to do takes half the running sequences of the most loaded rollout ranks, oldest
  groups first (`PipelinePolicy.rebalance_moves`), which continue from their prefix, and new episodes go
  to the rollout ranks; without, new episodes go to the lent ranks by load. When the batch is ready they
  are reclaimed: their unfinished generations continue on rollout ranks from their prefix (prefilled
  there), and training starts once the trainer's state is back. Without lendable ranks it runs as
  ``async`` (and says so in `SimResult.note`).

Time accounting per rank, over the measured steps (after `warmup_steps`): generating (an engine with a
sequence in its batch), training, syncing (weight update), switching (an engine woken or put to sleep on
a trainer GPU, the trainer state moved), waiting (everything else). Bubble fraction = waiting
rank-seconds / total rank-seconds, per role.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
from collections import defaultdict
from typing import Any

import numpy as np

from sfhpc.data.rank_intervals import RankInterval
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.rl.pipeline_policy import PipelinePolicy
from sfhpc.rl.scheduler import RankState, Scheduler
from sfhpc.sim.clock import EventQueue
from sfhpc.sim.cluster import SimCluster
from sfhpc.sim.cost_model import CostModel
from sfhpc.sim.engine import SimEngine
from sfhpc.sim.workload import Group, Sample, Workload
from sfhpc.tasks.base import Problem

REPLACE_EVERY_S = 1.0


@dataclasses.dataclass(frozen=True)
class SimConfig:
    mode: str
    workload: Workload
    prompts_per_step: int      # GRPO groups per training step
    steps: int = 6
    warmup_steps: int = 2      # left out of the figures (the pipeline filling up)
    max_staleness: int = 2
    max_token_lag: int | None = None  # drop groups holding an older token (None: none dropped for its age)
    seed: int = 0
    timeline: bool = False     # record busy-rank counts over time (for a chart)
    intervals: bool = False    # keep every rank's state intervals, as a run's store does (for a trace)
    rebalance: bool = True     # seamless: a lent rank that runs dry takes half the batch of a loaded rollout rank
    staged_updates: bool = False  # engine.staged_updates: engines generate while a version comes in, pause to load it

    def __post_init__(self) -> None:
        self.policy()  # refuses a mode or bound it does not know
        if self.steps <= self.warmup_steps:
            raise ValueError(f"steps ({self.steps}) must be more than warmup_steps ({self.warmup_steps})")

    def policy(self) -> PipelinePolicy:
        return PipelinePolicy(self.mode, self.prompts_per_step, self.max_staleness, self.max_token_lag,
                              rebalance=self.rebalance)


@dataclasses.dataclass
class SimResult:
    mode: str
    gpus: int
    trainer_gpus: int
    rollout_gpus: int
    measured_steps: int
    seconds: float                      # simulated, over the measured steps
    trained_tokens: int
    generated_tokens: int
    trained_tokens_per_s: float
    generated_tokens_per_s: float
    step_s_mean: float
    bubble: dict[str, float]            # role -> waiting rank-seconds / total rank-seconds
    waiting_rank_s: float               # every rank's waiting seconds, summed
    shares: dict[str, dict[str, float]]  # role -> state -> share of rank-seconds
    tokens_discarded: int
    groups_discarded: int
    staleness_mean: float
    staleness_max: int
    lends: int
    reclaims: int
    reclaim_latency_mean_s: float       # batch ready -> training started
    reclaim_latency_max_s: float
    migrated_samples: int               # generations continued elsewhere from their prefix (reclaims)
    events: int
    note: str = ""
    timeline: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    phases: list[dict[str, float]] = dataclasses.field(default_factory=list)
    intervals: list[RankInterval] = dataclasses.field(default_factory=list)  # with `SimConfig.intervals`

    def as_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("timeline", "phases", "intervals")}


class PipelineSim:
    def __init__(self, cluster: SimCluster, cost: CostModel, config: SimConfig) -> None:
        self.cluster, self.cost, self.config = cluster, cost, config
        self.mode = config.mode
        self.policy = config.policy()
        self.clock = EventQueue()
        lending = self.mode == "seamless" and cluster.lending_allowed
        # The real scheduler, its timeline on the simulated clock (sums only, unless `SimConfig.intervals`).
        self.scheduler = Scheduler(cluster.plan(colocated=self.mode == "sync"), lending=lending,
                                   clock=lambda: self.clock.now, keep_intervals=config.intervals)
        self.note = ""
        if self.mode == "seamless" and not self.scheduler.lendable_ranks:
            self.note = "no lendable ranks (the trainer's pool is not tagged rollout): ran as async"
        self.trainer_ranks = self.scheduler.trainer_ranks
        self.trainer_set = frozenset(self.trainer_ranks)
        self.trainer_gpu = cluster.trainer_pool.gpu_type or ""
        engine_ranks = set(self.scheduler.rollout_ranks) | set(self.scheduler.lendable_ranks)
        self.engines: dict[int, SimEngine] = {}
        # A staged version's load: every engine's, the slowest GPU's (the step waits for the last engine).
        self.staged_load_s = max((cost.staged_load_s(cluster.gpu_type(r)) for r in engine_ranks), default=0.0)
        for rank in sorted(engine_ranks):
            gpu = cluster.gpu_type(rank)
            # Engines on trainer GPUs sleep until lent (seamless); colocated ones start awake (sync).
            self.engines[rank] = SimEngine(rank, gpu, cost.device(gpu), self.clock, self._turn_ended,
                                           available=not (rank in self.trainer_set and self.mode != "sync"),
                                           on_busy_change=self._busy_changed if config.timeline else None)
        self.rng = np.random.default_rng(config.seed)
        self.version = 0
        self.step = 0
        self.groups_out = 0
        self.playing: dict[Group, None] = {}  # groups handed out with a member still playing
        self.next_group = 0
        self.next_sample = 0
        self.samples: dict[int, Sample] = {}      # in flight, by id (the EpisodeTicket's seed)
        self.ended: dict[int, int] = defaultdict(int)  # rank -> episodes that ended there
        self.ready: list[tuple[int, Group]] = []  # complete groups, oldest first
        # rank -> samples waiting on their environment (a dict: the order they are moved in is reproducible)
        self.in_env: dict[int, dict[Sample, None]] = defaultdict(dict)
        self.waiting_for_batch = False
        self.top_up_pending = False
        self.drained: dict[int, None] = {}  # lent ranks that ran out of episodes (rebalance)
        self.rebalance_pending = False
        self.lent_at = 0.0
        self.lend_s = 0.0
        self.lent: tuple[int, ...] = ()
        self.batch_tokens = 0      # trained tokens of the batch being trained
        self.batch_ready_at = 0.0
        self.done = False
        # Figures (over the measured window).
        self.window_start: float | None = None
        self.window_end = 0.0
        self.trainer_s: dict[str, float] = defaultdict(float)  # state -> seconds of every trainer rank
        self.sync_s = 0.0
        self.trained_tokens = 0
        self.generated_tokens = 0
        self.staleness: list[int] = []
        self.tokens_discarded = 0
        self.groups_discarded = 0
        self.reclaim_latency: list[float] = []
        self.migrated = 0
        self.lends_at_start = 0
        self.reclaims_at_start = 0
        self.step_started = 0.0
        self.step_times: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.timeline: dict[str, list[tuple[float, float]]] = {"trainer": [], "rollout": []}
        self._busy = {"trainer": 0, "rollout": 0}

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self.clock.at(0.0, self._start_step)
        # Hundreds of thousands of live samples: the cyclic collector would rescan them on every few
        # thousand allocations (most of the run's time); what the run leaves is collected once at the end.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.clock.run()
        finally:
            if collecting:
                gc.enable()
        return self._result()

    @property
    def measuring(self) -> bool:
        return self.window_start is not None

    def _start_step(self, _: Any = None) -> None:
        if self.step == self.config.steps:
            self._finish()
            return
        self.step += 1
        self.step_started = self.clock.now
        if self.step == self.config.warmup_steps + 1:
            self._open_window()
        self.scheduler.begin_step(self.step)
        self.phases.append({"step": self.step, "start": self.clock.now})
        self.waiting_for_batch = True
        if lend := self.policy.to_lend(self.scheduler.lendable_ranks, self.lent,
                                       batch_ready=self.policy.batch_ready(len(self.ready))):
            self._lend(lend)
        self._keep_rollouts_busy()
        self._try_take_batch()

    def _keep_rollouts_busy(self) -> None:
        """The controller's hand-out: the groups the policy admits, by load."""
        cfg = self.config
        overdue = sum(1 for g in self.playing if self.policy.overdue(self.version, g.oldest_version))
        new = self.policy.admit(self.groups_out, overdue)
        if not new:
            return
        episodes = []
        workload = cfg.workload
        size = workload.group_size
        replies = workload.replies(self.rng, new * size)
        samples = self.samples
        for g in range(new):
            group = Group(self.next_group)
            problem = Problem(f"p{self.next_group}", None)
            key = f"g{self.next_group}"
            self.next_group += 1
            for k in range(size):
                sample = workload.sample(self.next_sample, group, replies[g * size + k])
                self.next_sample += 1
                group.members.append(sample)
                self.playing[group] = None
                samples[sample.id] = sample
                episodes.append(EpisodeTicket(problem, key, sample.id))
        self.groups_out += new
        self._hand_out(episodes, new=True)

    def _hand_out(self, episodes: list[EpisodeTicket], *, new: bool = False) -> None:
        to_lent = not new or self.policy.new_episodes_to_lent
        for rank, share in self.scheduler.assign(episodes, ended=self.ended, to_lent=to_lent).items():
            self.engines[rank].admit(self.samples[e.seed] for e in share)

    def _turn_ended(self, sample: Sample, engine: SimEngine) -> None:
        if not sample.finish_turn():
            self.in_env[engine.rank][sample] = None
            self.clock.after(self.config.workload.env_s, self._env_answered, sample)
            return
        rank = engine.rank
        self.ended[rank] += 1
        if self.scheduler.in_flight(rank, self.ended) == 0:  # (before that, its state on the timeline holds)
            self.scheduler.observe(self.ended, (rank,))
            if self.policy.rebalance and self.lent and rank in self.trainer_set and self.waiting_for_batch:
                self.drained[rank] = None
                if not self.rebalance_pending:
                    self.rebalance_pending = True
                    self.clock.after(REPLACE_EVERY_S, self._rebalance)
        del self.samples[sample.id]
        group = sample.group
        group.finished += 1
        if group.finished == len(group.members):
            self.playing.pop(group, None)
            self._group_complete(group)

    def _env_answered(self, sample: Sample) -> None:
        if sample not in self.in_env[sample.rank]:
            return  # moved at a reclaim (and admitted where it continues)
        del self.in_env[sample.rank][sample]
        self.engines[sample.rank].admit((sample,))

    def _stale(self, group: Group) -> bool:
        return not self.policy.trainable(self.version, group.oldest_version, group.oldest_version)

    def _group_complete(self, group: Group) -> None:
        if self._stale(group):
            self._drop(group)
            return
        heapq.heappush(self.ready, (group.index, group))
        self._try_take_batch()

    def _drop(self, group: Group) -> None:
        """A stale group: its tokens are thrown away and it is replaced (as the trajectory manager does)."""
        group.dropped = True
        self.groups_out -= 1
        if self.measuring:
            self.groups_discarded += 1
            self.tokens_discarded += sum(sum(s.replies) for s in group.members)
        if self.waiting_for_batch and not self.top_up_pending:
            # Replaced in one hand-out per simulated second (the controller notices drops as it polls).
            self.top_up_pending = True
            self.clock.after(REPLACE_EVERY_S, self._top_up)

    def _top_up(self, _: Any = None) -> None:
        self.top_up_pending = False
        if self.waiting_for_batch:
            self._keep_rollouts_busy()

    def _rebalance(self, _: Any = None) -> None:
        """Lent ranks that ran dry take half the running sequences of the most loaded rollout ranks (the
        oldest groups' first: they hold the batch back); the moved ones continue from their prefix."""
        self.rebalance_pending = False
        drained = [r for r in self.drained if self.lent and self.scheduler.in_flight(r, self.ended) == 0]
        self.drained.clear()
        if not drained or not self.waiting_for_batch:
            return
        running = {r: [(entry[2].group.index, entry[1]) for entry in e.running]
                   for r, e in self.engines.items() if r not in self.trainer_set and e.running}
        moved: list[Sample] = []
        for donor, wanted in self.policy.rebalance_moves(drained, running, trainer_waits=True).items():
            out = self.engines[donor].take(set(wanted))
            self.scheduler.withdraw(donor, len(out))
            moved.extend(out)
        if moved:
            if self.measuring:
                self.migrated += len(moved)
            self._hand_out([EpisodeTicket(Problem(str(s.id), None), "", s.id) for s in moved])

    def _try_take_batch(self) -> None:
        per_step = self.config.prompts_per_step
        if not self.waiting_for_batch or not self.policy.batch_ready(len(self.ready)):
            return
        self.waiting_for_batch = False
        groups = [heapq.heappop(self.ready)[1] for _ in range(per_step)]
        self.groups_out -= per_step
        tokens = 0
        for group in groups:
            for sample in group.members:
                tokens += sample.trained_tokens
                if self.measuring:
                    self.generated_tokens += sum(sample.replies)
                    self.staleness.append(self.version - max(sample.first_version, 0))
        self.batch_tokens = tokens
        self.batch_ready_at = self.clock.now
        self.phases[-1]["batch_ready"] = self.clock.now
        n = len(self.trainer_ranks)
        reclaim = self.policy.reclaim_now(self.lent, batch_ready=True)
        if self.mode != "sync" and not reclaim:
            self.clock.after(0.0, self._train)
            return
        if reclaim:
            self._reclaim()
        else:
            for rank in self.trainer_ranks:  # colocated: every trainer GPU's engine to sleep
                self.engines[rank].pause()
        switch = self.cost.reclaim_s(self.trainer_gpu, n)
        self._account_trainer("switching", switch)
        self.clock.after(switch, self._train)

    def _lend(self, ranks: tuple[int, ...]) -> None:
        self.lent = self.scheduler.lend(ranks)
        self.lent_at = self.clock.now
        self.lend_s = self.cost.lend_s(self.trainer_gpu, len(self.trainer_ranks))
        self.clock.after(self.lend_s, self._lent_engines_awake, self.step)

    def _lent_engines_awake(self, step: int) -> None:
        if step != self.step or not self.lent:
            return  # reclaimed before it woke
        for rank in self.lent:
            self.engines[rank].resume()
        if self.policy.rebalances and self.waiting_for_batch:  # awake with nothing to do: drained at once
            self.drained.update((r, None) for r in self.lent if self.scheduler.in_flight(r, self.ended) == 0)
            if self.drained and not self.rebalance_pending:
                self.rebalance_pending = True
                self.clock.after(0.0, self._rebalance)

    def _reclaim(self) -> None:
        """Batch ready: the lent ranks back to the trainer; their unfinished generations continue on rollout
        ranks from their prefix."""
        ranks = self.scheduler.reclaim()
        self._account_trainer("switching", min(self.lend_s, self.clock.now - self.lent_at))
        moved: list[Sample] = []
        in_env: dict[Sample, None] = {}
        for rank in ranks:
            engine = self.engines[rank]
            out = engine.evict()
            engine.available = False
            env = self.in_env.pop(rank, {})
            in_env.update(env)
            self.scheduler.withdraw(rank, len(out) + len(env))
            moved.extend(out)
            moved.extend(env)
        self.lent = ()
        if not moved:
            return
        if self.measuring:
            self.migrated += len(moved)
        tickets = [EpisodeTicket(Problem(str(s.id), None), "", s.id) for s in moved]
        plan = self.scheduler.assign(tickets, ended=self.ended)
        for rank, share in plan.items():
            samples = [self.samples[e.seed] for e in share]
            for sample in samples:
                if sample in in_env:  # still waiting for its environment: it answers to the new rank
                    sample.rank = rank
                    self.in_env[rank][sample] = None
            self.engines[rank].admit(s for s in samples if s not in in_env)

    def _train(self, _: Any = None) -> None:
        self.phases[-1]["train_start"] = self.clock.now
        self.reclaim_latency.append(self.clock.now - self.batch_ready_at)
        self.scheduler.set_state(self.trainer_ranks, RankState.TRAINING)
        train_s = self.cost.train_s(self.trainer_gpu, self.batch_tokens, gpus=len(self.trainer_ranks))
        self._account_trainer("training", train_s)
        if self.measuring:
            self.trained_tokens += self.batch_tokens
        self.clock.after(train_s, self._sync)

    def _sync(self, _: Any = None) -> None:
        """Every engine pauses and takes the new weights (its running sequences cut, to continue from their
        prefix under them, prefilled again). Staged (`SimConfig.staged_updates`): the engines generate while
        the version comes in, and pause to load it."""
        self.phases[-1]["sync_start"] = self.clock.now
        transfer_s = self.cost.weight_sync_s(len(self.engines))
        if not self.config.staged_updates:
            self._account_trainer("syncing", transfer_s)
            self._pause_engines(transfer_s)
            return
        self.scheduler.set_state(self.trainer_ranks, RankState.SYNCING)
        self._account_trainer("syncing", transfer_s + self.staged_load_s)
        self.clock.after(transfer_s, self._pause_engines, self.staged_load_s)

    def _pause_engines(self, seconds: float) -> None:
        """Every engine paused for `seconds` (taking the new weights), then `_synced`."""
        self.scheduler.set_state(self.scheduler.entries, RankState.SYNCING)
        for engine in self.engines.values():
            engine.pause(cut=True)
        if self.measuring:
            self.sync_s += seconds
        self.clock.after(seconds, self._synced)

    def _synced(self, _: Any = None) -> None:
        self.version += 1
        now = self.clock.now
        self.phases[-1]["end"] = now
        self.step_times.append(now - self.step_started)
        for rank, engine in self.engines.items():
            engine.version = self.version
            if rank in self.trainer_set and self.mode != "sync":
                continue  # a trainer GPU's engine sleeps until it is lent
            if rank not in self.trainer_set:
                engine.resume()
        self.scheduler.set_state(self.scheduler.entries, RankState.WAITING)  # generating where episodes are out
        if self.ready:  # the new version may leave complete groups too far behind
            keep = []
            for index, group in self.ready:
                if self._stale(group):
                    self._drop(group)
                else:
                    keep.append((index, group))
            heapq.heapify(keep)
            self.ready = keep
        if self.mode == "sync":
            if self.step == self.config.steps:
                self._start_step()
                return
            wake = self.cost.lend_s(self.trainer_gpu, len(self.trainer_ranks))
            self._account_trainer("switching", wake)
            self.clock.after(wake, self._colocated_awake)
        self._start_step()

    def _colocated_awake(self, _: Any = None) -> None:
        for rank in self.trainer_ranks:
            self.engines[rank].resume()

    # -- figures -------------------------------------------------------------------------------------
    def _account_trainer(self, state: str, seconds: float) -> None:
        if self.measuring and not self.done:
            self.trainer_s[state] += seconds

    def _busy_changed(self, engine: SimEngine, busy: bool) -> None:
        role = "trainer" if engine.rank < self.cluster.trainer_gpus else "rollout"
        self._busy[role] += 1 if busy else -1
        self.timeline[role].append((self.clock.now, self._busy[role]))

    def _open_window(self) -> None:
        self.window_start = self.clock.now
        for engine in self.engines.values():
            engine._advance()
            engine.generating_s = 0.0
        self.lends_at_start, self.reclaims_at_start = self.scheduler.lends, self.scheduler.reclaims
        self.timeline_at_start = self.scheduler.timeline.bubble(including_open=True)
        self.reclaim_latency.clear()
        self.step_times.clear()

    def _finish(self) -> None:
        self.window_end = self.clock.now
        for engine in self.engines.values():
            engine._advance()
        self.timeline_at_end = self.scheduler.timeline.bubble(including_open=True)
        self.done = True
        self.clock.stop()

    def _result(self) -> SimResult:
        assert self.window_start is not None
        window = self.window_end - self.window_start
        trainer = set(self.trainer_ranks)
        gen = {"trainer": 0.0, "rollout": 0.0}
        for rank, engine in self.engines.items():
            gen["trainer" if rank in trainer else "rollout"] += engine.generating_s
        n_trainer, n_rollout = len(trainer), len(self.engines) - len(trainer & set(self.engines))
        # The trainer's own phases are the same on each of its ranks (they train together); a trainer
        # rank's waiting is what is left after them and after its engine's generating.
        trainer_total = window * n_trainer
        t_shares = {
            "training": self.trainer_s["training"] * n_trainer,
            "syncing": self.trainer_s["syncing"] * n_trainer,
            "switching": self.trainer_s["switching"] * n_trainer,
            "generating": gen["trainer"],
        }
        t_shares["waiting"] = max(0.0, trainer_total - sum(t_shares.values()))
        rollout_total = window * n_rollout
        r_shares = {"generating": gen["rollout"], "syncing": self.sync_s * n_rollout}
        r_shares["waiting"] = max(0.0, rollout_total - sum(r_shares.values()))
        shares = {"trainer": {k: v / trainer_total for k, v in t_shares.items()},
                  "rollout": {k: v / rollout_total for k, v in r_shares.items()} if rollout_total else {}}
        # The bubble as a run reports it: from the scheduler's timeline (waiting rank-seconds / all), over
        # the measured window; roles as the timeline names them ("trainer,rollout" for colocated ranks).
        measured = self.timeline_at_end.since(self.timeline_at_start)
        bubble = {role: fraction for role, fraction in measured.by_role.items() if fraction is not None}
        bubble["all"] = measured.overall or 0.0
        waiting = sum(measured.waiting_s.values())
        latency = self.reclaim_latency or [0.0]
        return SimResult(
            mode=self.mode, gpus=self.cluster.gpus, trainer_gpus=self.cluster.trainer_gpus,
            rollout_gpus=self.cluster.rollout_gpus, measured_steps=self.config.steps - self.config.warmup_steps,
            seconds=window, trained_tokens=self.trained_tokens, generated_tokens=self.generated_tokens,
            trained_tokens_per_s=self.trained_tokens / window, generated_tokens_per_s=self.generated_tokens / window,
            step_s_mean=sum(self.step_times) / max(len(self.step_times), 1), bubble=bubble,
            waiting_rank_s=waiting, shares=shares,
            tokens_discarded=self.tokens_discarded, groups_discarded=self.groups_discarded,
            staleness_mean=sum(self.staleness) / max(len(self.staleness), 1),
            staleness_max=max(self.staleness, default=0),
            lends=self.scheduler.lends - self.lends_at_start, reclaims=self.scheduler.reclaims - self.reclaims_at_start,
            reclaim_latency_mean_s=sum(latency) / len(latency), reclaim_latency_max_s=max(latency),
            migrated_samples=self.migrated, events=self.clock.events, note=self.note,
            timeline=self.timeline, phases=self.phases, intervals=self._intervals())

    def _intervals(self) -> list[RankInterval]:
        """Every rank's state intervals over the run (empty unless `SimConfig.intervals`)."""
        if not self.config.intervals:
            return []
        self.scheduler.timeline.close()
        return self.scheduler.timeline.drain()


def simulate(cluster: SimCluster, cost: CostModel, config: SimConfig) -> SimResult:
    """One mode on one cluster: the measured figures."""
    return PipelineSim(cluster, cost, config).run()
