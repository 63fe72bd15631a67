"""The controller (world rank 0): trajectory manager, HDF5 store, scheduler, and the RL loop.

The loop itself is `run_loop`, one screen long. Everything it calls is a method of `Controller`:
handing out episodes by tag, waiting for a batch of whole GRPO groups within the staleness bound,
one training step on the trainer ranks, bringing every engine to the new weights.

Modes. ``sync`` hands out exactly one step's episodes and waits for them before training (colocated,
generate-then-train). ``async`` keeps up to ``(max_staleness + 1)`` steps of episodes out, so rollout
ranks keep generating while the trainer trains; a weight update pauses the engines, and interrupted
generations continue with the new weights (partial rollout); what is admitted, trained and dropped is the
pipeline policy's (`sfhpc.rl.pipeline_policy`), which the simulator asks too. ``seamless`` is ``async``
plus lending: trainer ranks whose nodes carry the ``rollout`` tag hold an engine too, play episodes while
the trainer waits for its batch, and are reclaimed the moment it is ready: their generations are cut at a
token boundary and continue from their prefix on the rollout ranks, then training starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from sfhpc.config.recipe import Recipe
from sfhpc.data.groups import DROP_CAUSES
from sfhpc.data.manager import Batch, TrajectoryManager
from sfhpc.data.rank_intervals import BubbleFraction  # the run's bubble fraction, from the timeline
from sfhpc.data.run_log import repair_log
from sfhpc.data.service import ManagerServer
from sfhpc.data.store import TrajectoryStore
from sfhpc.data.trajectory import Status
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.rl import health
from sfhpc.rl import messages as msg
from sfhpc.rl.attached import Departure, RoutedComm, left_behind, open_attach, replies_from, send_to
from sfhpc.rl.checkpoints import CONTROLLER_FILE, TRAINER_FILE, CheckpointInfo, RunCheckpoints, run_identity
from sfhpc.rl.distillation import Distillation
from sfhpc.rl.dynamic_sampling import DynamicSampling
from sfhpc.rl.evaluation import Evaluation
from sfhpc.rl.live_status import LiveStatus
from sfhpc.rl.pipeline_policy import PipelinePolicy
from sfhpc.rl.progress import Progress
from sfhpc.rl.resume import ControllerState, plan_resume
from sfhpc.rl.scheduler import RankState, Scheduler
from sfhpc.rl.trackers import open_trackers
from sfhpc.rollout.agent import reply_budget
from sfhpc.rundir import RunPaths
from sfhpc.runtime import preemption, requeue
from sfhpc.runtime.comm_layout import CommLayout
from sfhpc.tasks.base import Task
from sfhpc.trainer.overlong import Overlong, truncated_turns

log = logging.getLogger("sfhpc")
Moved = TypeVar("Moved", msg.Reclaimed, msg.Released)  # replies that give episodes up to continue elsewhere

STOP_GRACE_S = 120.0  # how long rollout ranks get to wind down their episodes after Stop
FAULT_STOP_GRACE_S = 10.0  # the same after a fault, which must end every rank within seconds
HEALTH_EVERY_S = 0.25  # between health checks while waiting: they count every trajectory's status
# In sync mode a stop request lets the step in progress finish (its episodes were all handed out at once,
# and a seeded run then resumes exactly) unless that takes longer than this.
SYNC_STOP_WAIT_S = 10.0
QUIESCE_TIMEOUT_S = 20.0  # a rollout rank that does not answer by then is being ended by Slurm
REBALANCE_EVERY_S = 0.25  # seamless: how often a wait looks for lent ranks that ran dry (steps may last a second)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    steps: int
    first_reward: float
    last_reward: float
    store: Path
    seconds: float
    store_seconds: float  # time the controller spent writing the HDF5 store (appends + flushes)
    store_tokens: int
    bubble: BubbleFraction | None = None  # waiting rank-seconds / all, from the scheduler's timeline


class Controller:
    def __init__(self, recipe: Recipe, plan: LaunchPlan, layout: CommLayout, task: Task, run_dir: Path, *,
                 model_dir: Path, resume_from: CheckpointInfo | None = None, restart: int = 0,
                 job_id: str | None = None) -> None:
        self.recipe, self.layout, self.task, self.run_dir = recipe, layout, task, run_dir
        self.resume_from, self.restart, self.job_id = resume_from, restart, job_id
        self.scheduler = Scheduler(plan, lending=recipe.pipeline.mode == "seamless")
        self.store_path = RunPaths(run_dir).store
        self.store = TrajectoryStore.open(self.store_path,
                                          run_metadata={"recipe": recipe.name, "source": recipe.source,
                                                        "model": str(model_dir)})  # its tokenizer
        self.policy = PipelinePolicy.of(recipe)
        self.overlong = Overlong.of(recipe.algorithm.overlong, reply_budget(task, recipe.budgets.max_new_tokens))
        self.manager = TrajectoryManager(self.store, max_token_lag=self.policy.max_token_lag)
        self.sampling = DynamicSampling.of(recipe.algorithm, self.overlong, self.manager)
        if self.sampling is not None:
            self.sampling.start()
        # algorithm.distill: every batch is scored by the teacher ranks before it trains.
        self.distillation = (Distillation(layout, self.manager, self.stop_requested)
                             if recipe.algorithm.distill is not None else None)
        # Rollout workers of other jobs (`sfhpc attach`) reach the controller over links of their own, beside
        # the world: commands and the manager's requests to a rank beyond it go over its link.
        self.attached = open_attach(recipe, RunPaths(run_dir).attach, layout.world.Get_size())
        manager_link = layout.manager_link
        if self.attached is not None:
            self.layout = dataclasses.replace(layout, world=RoutedComm(layout.world, self.attached))
            manager_link = RoutedComm(layout.manager_link, self.attached, drop_to_gone=True)
        # Lendable trainer ranks play episodes too: their agents call the manager like a rollout rank's.
        self.server = ManagerServer(self.manager, manager_link,
                                    clients=self.scheduler.rollout_ranks + self.scheduler.lendable_ranks)
        self._stop_serving = threading.Event()
        # The timeline: into the store with every flush; an episode's end may make its rank idle at once.
        self.manager.follow_timeline(self.scheduler.timeline.drain)
        self.server.on_episode_end = lambda rank: self.scheduler.observe(self.server.episodes_ended, (rank,))
        self._serving = threading.Thread(target=self.server.serve, args=(self._stop_serving,),
                                         name="sfhpc-manager", daemon=True)
        self._serving.start()
        self.rng = random.Random(recipe.seed)
        self.version = 0
        self.step_done = 0  # the last training step whose weights the trainers hold
        self.hopeless_checked = 0  # the policy version whose hopeless groups were dropped last
        self.hopeless_groups = 0  # groups dropped as stale while they still played, this run (for metrics)
        self.next_group = 0
        self._state_checked = False
        self._dropped_before: dict[str, int] = {}
        # The episodes of the groups in flight, for the checkpoint (the manager's book says which are).
        self.open_groups: dict[str, tuple[msg.EpisodeTicket, ...]] = {}
        # The event log of a folder opened again: a crash may have cut its last line, which is set aside
        # before the first event is appended (the metrics likewise, by `Progress`).
        repair_log(RunPaths(run_dir).events)
        self.progress = Progress(run_dir, recipe.budgets.steps, trackers=open_trackers(recipe, run_dir))
        self.checkpoints = RunCheckpoints(run_dir)
        self.identity = run_identity(recipe, model_dir)
        self.last_checkpoint: CheckpointInfo | None = resume_from
        self.live = LiveStatus(run_dir, restart=restart, job_id=job_id)
        self.stop_watch = preemption.StopWatch(layout.world)
        self.stopping: tuple[int, str] | None = None  # (rank, signal) of the stop request being acted on
        self._stop_noticed = 0.0
        self.started = time.monotonic()
        self.last_reclaim: dict[str, float | int] = {}  # the step's reclaim figures, for its metrics row
        self.update_bytes = 0  # the last weight update's bytes on the wire (the publisher's buckets)
        self.engine_restarts: dict[int, int] = {}  # rollout rank -> its engine's restarts in this allocation
        self.rebalanced = 0  # episodes moved onto lent ranks that ran dry, this step (for its metrics row)
        self.evaluation = None if recipe.evaluation is None else Evaluation(
            recipe.evaluation, task, source=recipe.source, seed=recipe.seed, last_step=recipe.budgets.steps)
        self.last_evaluation: dict[str, float | int] = {}  # the step's evaluation, for its metrics row
        if self.evaluation is not None:
            print(self.evaluation.describe(), flush=True)
        self._overdue, self._overdue_at = 0, (-1, -1, -1)  # overdue groups, and (version, ended, out) then
        self._announce_lending()

    # -- the steps of the loop ---------------------------------------------------------------------
    @property
    def groups_out(self) -> int:
        """GRPO groups handed out and not yet trained on or dropped: the trajectory manager's book, the one
        count of them (every path that ends a group ends it there)."""
        return self.manager.groups_in_flight()

    def groups_to_admit(self) -> int:
        """New groups to hand out now (`PipelinePolicy.admit`): one step's worth in flight (sync), or up to
        the staleness bound's, not counting groups overdue for it (async)."""
        # The wait asks this every few milliseconds, and counting overdue groups reads every member's token
        # versions: counted again only when it can change (a new version, an episode's end, a group handed
        # out or leaving the book).
        key = (self.version, sum(self.server.episodes_ended.values()), self.groups_out)
        if key != self._overdue_at:
            self._overdue_at = key
            self._overdue = self.manager.overdue_groups(self.version, self.policy.overdue_lag,
                                                        self.recipe.algorithm.group_size)
        return self.policy.admit(self.groups_out, self._overdue)

    def keep_rollouts_busy(self) -> None:
        """Hand out episodes as the pipeline policy admits them, also in place of the groups trained on,
        dropped as stale or spoiled by a failed member."""
        self.drop_hopeless_groups()
        self.open_groups = {g: e for g, e in self.open_groups.items() if self.manager.in_flight(g)}
        episodes: list[msg.EpisodeTicket] = []
        for _ in range(self.groups_to_admit()):
            problem = self.task.sample(self.rng)
            # The store's writer session makes the key unique across allocations: a restart restores
            # `next_group` from its checkpoint, and the lost allocation's later keys may be in the store.
            group = f"s{self.store.session}-g{self.next_group}-{problem.key}"
            self.next_group += 1
            members = tuple(msg.EpisodeTicket(problem, group, self.rng.randrange(2**31))
                            for _ in range(self.recipe.algorithm.group_size))
            self.manager.book_group(group)
            self.open_groups[group] = members
            episodes += members
            if not self._state_checked:  # a task whose problems no checkpoint could hold stops now, not then
                self._state().to_json(self.task)
                self._state_checked = True
        self.hand_out(episodes, new=True)

    def evaluate_if_due(self, step: int) -> None:
        """After training step `step` (0: before the first), when the recipe's evaluation is due: its episodes
        are handed out like any (to lent ranks too) and awaited, no weight update between, and their scores
        go into the step's metrics row (step 0: a row of its own). A run the wall-clock budget ends after this
        step is evaluated now, its last. A stop request cuts an evaluation: its episodes are cancelled and
        nothing is scored."""
        if self.evaluation is None or self.stop_requested() or not (self.evaluation.due(step) or self.out_of_time()):
            return
        started = time.monotonic()
        tickets, groups = self.evaluation.tickets(self.store.session, step)
        self.live.enter("evaluation", step)
        # seamless: the trainer ranks wait for it too, so they play it, lent; they stay lent into the next
        # step, which takes them back when its batch is ready.
        self.scheduler.lend(self.policy.to_lend(self.scheduler.lendable_ranks, self.scheduler.lent_ranks,
                                                batch_ready=False))
        self.hand_out(tickets)
        next_check = started
        while (ended := self.manager.take_evaluation(groups, self.evaluation.spec.samples)) is None:
            if time.monotonic() >= next_check:
                self.check_health(started)  # a fault raises; the wall-clock budget waits for the evaluation
                next_check = time.monotonic() + HEALTH_EVERY_S
            if self.stop_requested():
                self.cancel_groups(groups)
                for group in groups:
                    self.manager.drop_group(group, Status.ABORTED)
                self.event("evaluation-cut", step=step, version=self.version)
                return
            time.sleep(0.005)
        score = self.evaluation.score(step, self.version, ended, time.monotonic() - started)
        print(score.line(), flush=True)
        self.event("evaluated", step=step, **score.metrics())
        if step == 0:
            self.progress.evaluated_before_training(score.metrics())
        else:
            self.last_evaluation = score.metrics()

    def drop_hopeless_groups(self) -> int:
        """Once per new policy version: the groups that can no longer be trained on (a member's token is
        older than ``pipeline.max_token_lag`` allows) are dropped now, and their episodes stopped wherever they play,
        instead of running on to the end to be dropped then: a long reply of a doomed group would otherwise
        hold engine time and a place among the groups in flight. Returns how many were dropped."""
        if self.version <= self.hopeless_checked:
            return 0
        self.hopeless_checked = self.version
        groups = tuple(self.manager.drop_hopeless(self.version))
        if not groups:
            return 0
        self.cancel_groups(groups)
        self.hopeless_groups += len(groups)
        return len(groups)

    def cancel_groups(self, groups: Sequence[str]) -> None:
        """The episodes of `groups` stop wherever they play (and leave their ranks' counts)."""
        ranks = [r for r in self.scheduler.assignable_ranks if send_to(self.layout.world, r, msg.Cancel(tuple(groups)))]
        for reply in replies_from(self.layout.world, ranks, msg.Cancelled, idle=self.stop_requested):
            self.scheduler.withdraw(reply.rank, reply.episodes - len(reply.routed))
            for rank in reply.routed:  # counted where its generation went (`carry`)
                self.scheduler.withdraw(rank, 1)

    def lend_idle_trainers(self, step: int) -> None:
        """Step `step` begins (the timeline's intervals from now on belong to it). seamless: the trainer ranks
        that may be lent serve rollouts until the batch is ready; none when it is ready already. With
        rebalancing a lent rank takes over running episodes of the oldest groups (`rebalance_lent`), those that
        hold the batch back, and new episodes go to the rollout ranks; without, new ones go to it by load."""
        self.scheduler.begin_step(step)
        ready = self.policy.batch_ready(self.manager.complete_groups(self.version, self.recipe.algorithm.group_size))
        lent = self.scheduler.lend(self.policy.to_lend(self.scheduler.lendable_ranks, self.scheduler.lent_ranks,
                                                       batch_ready=ready))
        if self.policy.routes_programs:
            # Agent programs' generations reach a lent rank through its engine door (`Release(to=...)`), not in a
            # `Play`: an empty one tells it it is lent, so that it serves turns again (refused since its reclaim).
            for rank in lent:
                send_to(self.layout.world, rank, msg.Play(()))

    def reclaim_lent(self, step: int) -> None:
        """The batch is ready: every lent rank goes back to training. Its generations are cut at a token
        boundary (recorded as partial rollouts) and its unfinished episodes continue on the rollout ranks
        from their prefix; then training can start. The time this takes is the step's ``reclaim_s``."""
        started = time.monotonic()
        if not self.policy.reclaim_now(self.scheduler.lent_ranks, batch_ready=True):
            return
        ranks = self.scheduler.reclaim()
        ended = self.server.episodes_ended
        counts = {rank: max(0, self.scheduler.in_flight(rank, ended)) for rank in ranks}
        targets = self.scheduler.routes(counts, self._route_targets())
        replies = self._move_episodes({rank: msg.Reclaim(targets[rank]) for rank in ranks}, msg.Reclaimed)
        moved = [episode for reply in replies for episode in reply.episodes]
        routed = sum(len(reply.routed) for reply in replies)
        seconds = time.monotonic() - started
        interrupted = sum(r.interrupted for r in replies)
        self.last_reclaim = {"reclaim_s": seconds, "reclaimed_ranks": len(ranks), "reclaim_interrupted": interrupted,
                             "reclaim_moved": len(moved) + routed,
                             "continued": sum(e.resume_id is not None for e in moved) + routed}
        self.event("reclaimed", step=step, ranks=list(ranks), seconds=round(seconds, 4), interrupted=interrupted,
                   moved=len(moved) + routed, continued=self.last_reclaim["continued"], routed=routed)

    def rebalance_lent(self, step: int) -> int:
        """seamless, while the trainer waits: lent ranks that ran out of episodes take running ones of the
        most loaded rollout ranks (`PipelinePolicy.rebalance_counts`); each donor cuts those of its oldest
        groups at a token boundary and they continue from their prefix here, by load. Returns how many moved."""
        lent = self.scheduler.lent_ranks
        if not lent:
            return 0
        ended = self.server.episodes_ended
        drained = [r for r in lent if self.scheduler.in_flight(r, ended) <= 0]
        loads = {r: self.scheduler.in_flight(r, ended) for r in self.scheduler.rollout_ranks}
        counts = self.policy.rebalance_counts(drained, loads, trainer_waits=True)
        if not counts:
            return 0
        targets = self.scheduler.routes(counts, self._route_targets(drained))
        replies = self._move_episodes({rank: msg.Release(count, targets[rank]) for rank, count in counts.items()},
                                      msg.Released)
        moved = sum(len(reply.episodes) for reply in replies)
        routed = sum(len(reply.routed) for reply in replies)
        self.rebalanced += moved + routed
        if moved + routed:
            self.event("rebalanced", step=step, drained=drained,
                       donors={str(r.rank): len(r.episodes) + len(r.routed) for r in replies}, moved=moved + routed,
                       routed=routed)
        return moved + routed

    def _route_targets(self, among: Sequence[int] | None = None) -> tuple[int, ...]:
        """The ranks a moved agent program's generation may go to (`sfhpc.engine.remote`): `among` (default: the
        rollout ranks of the run's world, whose engine doors are open); none where programs' episodes do not
        move (no agent program, or not ``seamless``)."""
        if not self.policy.routes_programs:
            return ()
        ranks = self.scheduler.rollout_ranks if among is None else among
        return tuple(r for r in ranks if self.attached is None or r not in self.attached.links)

    def _move_episodes(self, commands: dict[int, object], reply_type: type[Moved]) -> list[Moved]:
        """Send each rank its command (Reclaim, Release); the episodes their replies give up leave those ranks'
        counts and go to other ranks by load, to continue from their prefix. Returns the replies."""
        ranks = [rank for rank, command in commands.items() if send_to(self.layout.world, rank, command)]
        replies = replies_from(self.layout.world, ranks, reply_type, idle=self.stop_requested)
        for reply in replies:
            self.scheduler.withdraw(reply.rank, len(reply.episodes) + len(reply.routed))
            self.moved_from(reply.rank, reply.episodes)
            for rank in reply.routed:  # an agent program's episode: its program stays, its generation went there
                self.scheduler.carry(rank, 1)
        self.hand_out([episode for reply in replies for episode in reply.episodes])
        return replies

    def _announce_lending(self) -> None:
        if self.recipe.pipeline.mode != "seamless":
            return
        lendable = self.scheduler.lendable_ranks
        if lendable:
            line = (f"seamless: trainer ranks {','.join(map(str, lendable))} are lent to rollout while the trainer "
                    "waits for its batch, and reclaimed when it is ready")
        elif set(self.scheduler.trainer_ranks) <= set(self.scheduler.rollout_ranks):
            line = "seamless: the trainer ranks roll out already (colocated), so none is lent: this run is async"
        else:
            line = ("seamless: no trainer rank's node carries the 'rollout' tag (the cluster map does not allow "
                    "lending), so this run is async")
        print(line, flush=True)
        self.event("pipeline", mode="seamless" if lendable else "async", requested="seamless",
                   lendable=list(lendable))

    def hand_out(self, episodes: list[msg.EpisodeTicket], *, new: bool = False) -> None:
        """Episodes to ranks by load; `new` ones (just admitted) to lent ranks only as the policy says."""
        to_lent = not new or self.policy.new_episodes_to_lent
        for rank, share in self.scheduler.assign(episodes, ended=self.server.episodes_ended, to_lent=to_lent).items():
            if self.attached is not None:
                self.attached.note_handed(rank, tuple(share))  # (a worker that left meanwhile plays them again)
            send_to(self.layout.world, rank, msg.Play(tuple(share)))

    def wait_for_batch(self, step: int) -> Batch | None:
        """Whole, fresh groups for one step (polls the manager; stale groups, and groups a failed member
        spoiled, are dropped and replaced). None when a stop request comes first (in sync mode: unless the
        step's batch is done soon) or ``budgets.wall_minutes`` runs out; a fault raises (`check_health`)."""
        per_step, size = self.recipe.budgets.prompts_per_step, self.recipe.algorithm.group_size
        self.live.enter("rollout", step)
        waiting_since = next_check = next_rebalance = time.monotonic()
        while True:
            if self.sampling is not None:
                self.sampling.keep_bound(per_step)
            batch = self.manager.take_batch(self.version, per_step, size, step)
            if batch is not None:
                return batch
            if self.stop_requested() and not self._finish_step_first():
                return None
            if time.monotonic() >= next_check:
                if not self.check_health(waiting_since):
                    return None  # out of wall-clock time: the run ends as after its last step
                next_check = time.monotonic() + HEALTH_EVERY_S
            # Complete groups found too stale, and groups a failed member spoiled, are never trained on:
            # they left the manager's book, and others replace them.
            if self.groups_to_admit():
                self.keep_rollouts_busy()
            if self.policy.rebalances and time.monotonic() >= next_rebalance:
                self.rebalance_lent(step)
                next_rebalance = time.monotonic() + REBALANCE_EVERY_S
            self.follow_attached(step)
            time.sleep(0.005)

    def check_health(self, waiting_since: float) -> bool:
        """Faults fail fast (`sfhpc.rl.health`): raise a `RunFault` when too many episodes failed, when no
        rollout rank was heard from since `waiting_since` (time.monotonic()) for ``budgets.stall_timeout_s``,
        or when a one-way call to the trajectory manager failed; every rank is stopped first. Returns False
        when ``budgets.wall_minutes`` ran out (the run then stops cleanly)."""
        budgets = self.recipe.budgets
        try:
            health.check_one_way(self.server.first_one_way_failure)
            health.check_failures(self.manager.counts(), self.manager.fail_reasons(),
                                  max_fraction=budgets.max_failed_fraction,
                                  min_ended=budgets.prompts_per_step * self.recipe.algorithm.group_size)
            if self.groups_out > 0:
                health.check_stall(dict(self.server.last_seen), self.scheduler.rollout_ranks, since=waiting_since,
                                   now=time.monotonic(), timeout_s=budgets.stall_timeout_s)
        except health.RunFault as fault:
            self.stop_after_fault(fault)
            raise
        return not self.out_of_time()

    def stop_after_fault(self, fault: health.RunFault) -> None:
        """Every other rank is told to stop and the store is flushed before the fault ends the run (the fault
        path, `sfhpc.runtime.fault`, then ends every rank still there): the failed episodes stay readable."""
        self.event("fault", message=str(fault), step=self.step_done)
        self.stop_everyone()
        # Episodes in flight still make calls: keep answering them, for a while only (a hung rank never ends).
        self._serving.join(timeout=FAULT_STOP_GRACE_S)
        self._stop_serving.set()
        self._serving.join()
        self.scheduler.timeline.close()  # the timeline's last intervals go with the store's close
        self.manager.close()

    def train(self, step: int, batch: Batch) -> msg.Trained:
        from sfhpc.trainer.batch import TrainBatch

        self.live.enter("train", step)
        train_batch = TrainBatch.from_trajectories(batch.trajectories, overlong=self.overlong)
        if self.distillation is not None:
            train_batch = self.distillation.scored(step, train_batch, batch.trajectories)
        command = msg.Train(step, train_batch)
        trainers = self.scheduler.trainer_ranks
        self.scheduler.set_state(trainers, RankState.TRAINING)
        # The batch goes to the first trainer alone, which broadcasts it over the trainers' communicator;
        # the others are told only that a step begins (`TrainerWorker.train`).
        msg.send(self.layout.world, command, trainers[0])
        for rank in trainers[1:]:
            msg.send(self.layout.world, msg.Train(step, None), rank)
        reply = msg.receive_reply(self.layout.world, trainers[0], msg.Trained, idle=self.stop_requested)
        self.scheduler.set_state(trainers, RankState.WAITING)
        return reply

    def sync_weights(self, version: int) -> float:
        """Every engine to `version`; returns the longest pause a rollout rank saw.

        The trainer ranks sync until every engine holds the version; a rollout rank syncs, on the timeline, while
        its engine was paused (its own account): with ``engine.staged_updates`` it generates while the version
        comes in."""
        rollouts, trainers = self.scheduler.rollout_ranks, self.scheduler.trainer_ranks
        everyone = sorted(set(rollouts) | set(trainers))
        self.live.enter("broadcast", self.live.step)
        self.scheduler.set_state(trainers, RankState.SYNCING)
        told = [rank for rank in everyone if send_to(self.layout.world, rank, msg.SyncWeights(version))]
        answering = [r for r in rollouts if r in told] + ([trainers[0]] if trainers[0] not in rollouts else [])
        # A stop request is noted meanwhile (and acted on once every engine holds the new weights).
        replies = replies_from(self.layout.world, answering, msg.Synced, idle=self.stop_requested)
        for reply in replies:
            if reply.rank not in trainers and reply.paused_at:
                self.scheduler.was_paused(reply.rank, reply.paused_at, reply.paused_at + reply.seconds)
        self.scheduler.set_state(everyone, RankState.WAITING)
        self.version = version
        self.update_bytes = max(r.bytes for r in replies)
        self.note_engine_restarts(replies)
        return max(r.seconds for r in replies if r.rank in rollouts)

    def stop_everyone(self) -> None:
        """Stop to every other rank of the world, and to every attached worker still there."""
        for rank in range(1, self.layout.world.Get_size()):
            msg.send(self.layout.world, msg.Stop(), rank)
        for rank in () if self.attached is None else list(self.attached.links):
            send_to(self.layout.world, rank, msg.Stop())

    # -- rollout workers of other jobs (sfhpc attach) -------------------------------------------------
    def follow_attached(self, step: int) -> None:
        """Workers of other jobs whose engines are up join the scheduler (at the run's weights); those that left
        give their episodes back, to continue elsewhere (`sfhpc.rl.attached`)."""
        if self.attached is None:
            return
        for arrival in self.attached.arrivals():
            rank = arrival.rank
            # A version published while its engine started reaches it first (gone already: its departure is next).
            if arrival.version != self.version and not self._synced_alone(rank):
                continue
            self.scheduler.add_rank(rank, arrival.join.tags)
            self.server.open_clients.add(rank)  # it says goodbye at the end like a rollout rank
            self.server.followed.add(rank)  # what it leaves open, should it vanish
            self.event("worker-attached", rank=rank, node=arrival.join.node, worker_job=arrival.join.job_id, step=step,
                       version=self.version)
            print(f"rank {rank}: a rollout worker of job {arrival.join.job_id} on {arrival.join.node} joined the "
                  "run", flush=True)
        for gone in self.attached.departures():
            self._let_go(gone, step)

    def _let_go(self, gone: Departure, step: int) -> None:
        """A worker of another job left: out of the scheduler, and the episodes it held go on elsewhere (those it
        gave back from their prefix, the rest from the start)."""
        assert self.attached is not None
        self.scheduler.remove_rank(gone.rank)
        self.server.open_clients.discard(gone.rank)
        self.server.followed.discard(gone.rank)
        handed = self.attached.forget(gone.rank)
        given_back = () if gone.leaving is None else gone.leaving.episodes
        self.moved_from(gone.rank, given_back)
        # Whatever it still had open is given up (kept in the store as aborted, never trained on).
        opened = self.server.open_trajectories.pop(gone.rank, {})
        aborted = [tokens for tokens in map(self._abort_counting, opened) if tokens is not None]
        episodes = left_behind(handed, given_back, self.server.ended_by_group.pop(gone.rank, Counter()),
                               self.manager.in_flight)
        self.hand_out(episodes)
        continued = sum(e.resume_id is not None for e in episodes)
        self.event("worker-left", rank=gone.rank, step=step, reason=gone.reason, said=gone.leaving is not None,
                   interrupted=0 if gone.leaving is None else gone.leaving.interrupted, continued=continued,
                   started_again=len(episodes) - continued, aborted=len(aborted), lost_tokens=sum(aborted))
        print(f"rank {gone.rank}: the rollout worker left ({gone.reason}): {continued} episode(s) continue "
              f"elsewhere from their prefix, {len(episodes) - continued} start elsewhere"
              + (f" ({len(aborted)} trajectories it had open aborted, {sum(aborted)} generated tokens lost)"
                 if aborted else ""), flush=True)

    def _synced_alone(self, rank: int) -> bool:
        """`rank` to the run's weights, alone; False if it left meanwhile."""
        return send_to(self.layout.world, rank, msg.SyncWeights(self.version)) and bool(
            replies_from(self.layout.world, [rank], msg.Synced, idle=self.stop_requested))

    def moved_from(self, rank: int, episodes: tuple[msg.EpisodeTicket, ...]) -> None:
        """`episodes` left `rank` to continue elsewhere: their trajectories are no longer its own."""
        opened = self.server.open_trajectories.get(rank, {})
        for episode in episodes:
            if episode.resume_id is not None:
                opened.pop(episode.resume_id, None)
        if self.attached is not None:
            self.attached.note_moved(rank, episodes)

    def _abort_counting(self, trajectory_id: str) -> int | None:
        """Give up a trajectory a departed worker left open; returns the tokens it had generated for it (None: it
        had ended meanwhile, nothing is given up)."""
        if not Status(self.manager.status(trajectory_id)).is_open:
            return None
        generated = int(sum(self.manager.trajectory(trajectory_id).generated_mask()))
        self.manager.abort(trajectory_id)
        return generated

    def note_engine_restarts(self, replies: list[msg.Synced]) -> None:
        """An engine that died and was restarted inside its rank (``engine.max_restarts``), in the event log."""
        for reply in replies:
            if reply.restarts > self.engine_restarts.get(reply.rank, 0):
                self.engine_restarts[reply.rank] = reply.restarts
                self.event("engine-restarted", rank=reply.rank, restarts=reply.restarts, version=reply.version)
                print(f"rank {reply.rank}: its engine died and was restarted (restart {reply.restarts} of "
                      f"{self.recipe.engine.max_restarts})", flush=True)

    def report(self, step: int, batch: Batch, trained: msg.Trained, sync_s: float, step_s: float) -> None:
        rewards = [t.reward or 0.0 for t in batch.trajectories]
        metrics = trained.metrics
        self.progress.step({
            "step": step, "version": trained.version, "reward_mean": sum(rewards) / len(rewards),
            "trajectories": len(rewards), "generated_tokens": batch.num_generated, "trained_tokens": batch.num_tokens,
            "generated_tokens_per_s": batch.num_generated / step_s, "trained_tokens_per_s":
            batch.num_tokens / max(float(metrics.get("seconds", 0.0)), 1e-9),
            "train_s": float(metrics.get("seconds", 0.0)), "sync_s": sync_s, "update_bytes": self.update_bytes,
            "engine_restarts": sum(self.engine_restarts.values()),
            "attached_workers": 0 if self.attached is None else len(self.attached.ready),
            "step_s": step_s, **{k: metrics[k] for k in ("loss", "mean_ratio", "clip_fraction", "mean_staleness",
                                                          "max_staleness") if k in metrics},
            "loss_tokens": int(metrics.get("tokens", 0)),
            "hopeless_groups": self.hopeless_groups, "groups_in_flight": self.groups_out,
            "episodes_in_flight": self.episodes_in_flight(),
            "history_mismatches": sum(t.history_mismatches for t in batch.trajectories), **self._lending_metrics(),
            **self._dropped_metrics(), **self._overlong_metrics(batch), **self.last_evaluation,
            **(self.sampling.end_step(batch) if self.sampling is not None else {}),
            **(self.distillation.end_step() if self.distillation is not None else {}),
        })
        self.last_evaluation = {}

    def episodes_in_flight(self) -> int:
        """Episodes handed out that have not ended, as the scheduler counts them from the ranks' episode ends
        (one per episode, whatever its number of trajectories)."""
        ended = self.server.episodes_ended
        return sum(self.scheduler.in_flight(r, ended) for r in self.scheduler.entries)

    def _overlong_metrics(self, batch: Batch) -> dict[str, float]:
        """With ``algorithm.overlong``: the batch's replies cut by the length budget, and its mean length
        penalty (what DAPO's over-long handling did to the step)."""
        if self.overlong is None:
            return {}
        shifts = [self.overlong.shape(t)[0] for t in batch.trajectories]
        return {"overlong_cut_replies": sum(len(truncated_turns(t)) for t in batch.trajectories),
                "overlong_penalty_mean": -sum(shifts) / max(len(shifts), 1)}

    def _dropped_metrics(self) -> dict[str, int]:
        """The policy tokens dropped since the last step's row, by cause (``dropped_tokens_stale``, ...), so
        that the rows of a run add up to every token it generated and never trained on."""
        now = self.manager.dropped_tokens()
        row = {f"dropped_tokens_{cause.replace('-', '_')}": now.get(cause, 0) - self._dropped_before.get(cause, 0)
               for cause in DROP_CAUSES}
        self._dropped_before = now
        return row

    def _lending_metrics(self) -> dict[str, float | int]:
        """seamless with lendable ranks: the step's reclaim (0 when nothing was lent) and the run's counts."""
        if not self.scheduler.lendable_ranks:
            return {}
        row = {"reclaim_s": 0.0, "reclaim_interrupted": 0, "reclaim_moved": 0} | {
            k: v for k, v in self.last_reclaim.items() if k in ("reclaim_s", "reclaim_interrupted", "reclaim_moved")}
        row["rebalanced"] = self.rebalanced
        self.last_reclaim, self.rebalanced = {}, 0
        return row | {"lends": self.scheduler.lends, "reclaims": self.scheduler.reclaims}

    def checkpoint_if_due(self, step: int) -> None:
        """Every ``training.checkpoint_every`` steps (0: only at the end and at a stop request), and every
        ``training.export_every`` steps with a Hugging Face export of it."""
        self.step_done = step
        training = self.recipe.training
        export = bool(training.export_every) and step % training.export_every == 0
        if export or (training.checkpoint_every and step % training.checkpoint_every == 0):
            self.checkpoint("periodic")
        if export:
            self.export(step)

    def export(self, step: int) -> None:
        """The checkpoint of `step` as a Hugging Face folder in ``exports/`` (`sfhpc.rl.export`), written here,
        between steps: the trainers wait, and no later checkpoint can remove the one it reads meanwhile."""
        from sfhpc.rl.export import export

        started = time.monotonic()
        self.live.enter("export", step)
        out = RunPaths(self.run_dir).export(step)
        if out.exists():  # a restart redid the step: the export of the lost allocation's weights goes
            shutil.rmtree(out)
        export(self.run_dir, out, step=step)
        seconds = time.monotonic() - started
        print(f"exported step {step} to {out} ({seconds:.1f} s)", flush=True)
        self.event("exported", step=step, path=str(out), seconds=round(seconds, 3))

    def checkpoint(self, reason: str) -> CheckpointInfo:
        """One whole checkpoint of the run (see `sfhpc.rl.checkpoints`): the trainers write their state
        into the new folder, the store is flushed, then the controller's state and the manifest go last."""
        started = time.monotonic()
        self.live.enter("checkpoint", self.step_done)
        partial = self.checkpoints.begin(self.step_done)
        trainers = self.scheduler.trainer_ranks
        for rank in trainers:
            msg.send(self.layout.world, msg.Checkpoint(str(partial / TRAINER_FILE)), rank)
        msg.receive_reply(self.layout.world, trainers[0], msg.CheckpointWritten)
        self.manager.flush()
        self._state().save(partial / CONTROLLER_FILE, self.task)
        info = self.checkpoints.commit(partial, step=self.step_done, version=self.version, identity=self.identity,
                                       reason=reason, extra={"restart": self.restart})
        self.last_checkpoint = info
        self.event("checkpoint", path=str(info.path), step=info.step, version=info.version, reason=reason,
                   seconds=round(time.monotonic() - started, 3))
        self._prune_checkpoints()
        return info

    def _prune_checkpoints(self) -> None:
        """``training.keep_checkpoints``: the newest N of this run's checkpoints stay; the rest are removed,
        and said so on the console and in the event log."""
        keep = self.recipe.training.keep_checkpoints
        if keep is None:
            return
        removed = self.checkpoints.prune(keep, self.identity)
        if removed:
            names = ", ".join(p.name for p in removed)
            print(f"checkpoints: removed {names} (training.keep_checkpoints: {keep})", flush=True)
            self.event("checkpoints-removed", folders=[p.name for p in removed], keep=keep)

    def _state(self) -> ControllerState:
        # The groups in flight, also those with no trajectory yet (their episodes are played after a restart).
        self.open_groups = {g: e for g, e in self.open_groups.items() if self.manager.in_flight(g)}
        task_state = getattr(self.task, "state", None)
        return ControllerState(step=self.step_done, version=self.version, rng=self.rng.getstate(),
                               next_group=self.next_group, open_groups=dict(self.open_groups),
                               task_state=task_state() if callable(task_state) else None,
                               assigned={r: e.assigned for r, e in self.scheduler.entries.items()})

    def quiesce_rollouts(self) -> None:
        """Every generation in flight ends and is recorded as a partial rollout (engines stay paused), on the
        rollout ranks and on trainer ranks lent to rollout."""
        rollouts = [r for r in self.scheduler.rollout_ranks + self.scheduler.lent_ranks
                    if send_to(self.layout.world, r, msg.Quiesce())]
        try:
            replies = replies_from(self.layout.world, rollouts, msg.Quiesced, timeout=QUIESCE_TIMEOUT_S)
        except TimeoutError:
            log.warning("a rollout rank did not answer the quiesce within %.0f s", QUIESCE_TIMEOUT_S)
            self.event("quiesced", interrupted=None)
            return
        self.event("quiesced", interrupted=sum(r.interrupted for r in replies))

    def _after_stop(self) -> None:
        """Stopped by a signal, checkpoint on disk: under Slurm a USR1/USR2 stop requeues the job (after TERM
        Slurm requeues it itself); on one machine, say how to go on."""
        assert self.stopping is not None and self.last_checkpoint is not None
        signal_name = self.stopping[1]
        self.event("stopped", signal=signal_name, step=self.step_done, checkpoint=str(self.last_checkpoint.path))
        if self.job_id is None:
            print(f"stopped by {signal_name} after step {self.step_done}; checkpoint {self.last_checkpoint.path}; "
                  f"continue with: sfhpc run {self.recipe.source} --resume {self.run_dir}", flush=True)
            return
        from sfhpc.runtime.slurm_job import preempted_and_running, requeue_job

        enabled = self.recipe.launch.requeue
        # slurmctld is asked only where the answer counts: after TERM, a preemption under way.
        decision = requeue.decide(requeue.Situation(
            job_id=self.job_id, enabled=enabled, signal=signal_name,
            preempted=enabled and signal_name == "SIGTERM" and preempted_and_running(self.job_id)))
        if decision.line is not None:
            print(decision.line, flush=True)
        if decision.requeue:
            requeue_job(self.job_id)
            self.event("requeue-requested", job=self.job_id)

    # -- stop requests and restarts ----------------------------------------------------------------
    def stop_requested(self) -> bool:
        """Whether a stop signal reached any rank (the first one is kept, with the time it was noticed)."""
        if self.stopping is None and (request := self.stop_watch.stop_requested()) is not None:
            self.stopping = request
            self._stop_noticed = time.monotonic()
            self.event("stop-requested", rank=request[0], signal=request[1], phase=self.live.phase)
            print(f"stop requested: {request[1]} on rank {request[0]}; checkpointing at the next safe point",
                  flush=True)
        return self.stopping is not None

    def _finish_step_first(self) -> bool:
        return self.recipe.pipeline.mode == "sync" and time.monotonic() - self._stop_noticed < SYNC_STOP_WAIT_S

    def resume(self) -> int:
        """Continue from the checkpoint the run was started with (if any); returns the first step to run."""
        info = self.resume_from
        if info is None:
            return 1
        state = ControllerState.load(info.controller_file, self.task)
        self.step_done, self.version, self.next_group = state.step, state.version, state.next_group
        self.rng.setstate(state.rng)
        if state.task_state is not None and callable(restore := getattr(self.task, "restore", None)):
            restore(state.task_state)
        for rank, assigned in state.assigned.items():
            if rank in self.scheduler.entries:
                self.scheduler.entries[rank].assigned = assigned
        self.progress.resume(state.step)
        self.live.enter("resuming", state.step)
        if state.step >= self.recipe.budgets.steps:
            print(f"resumed at step {state.step}: the run is already complete", flush=True)
            return state.step + 1
        started = time.monotonic()
        if self.version > 0:
            self.sync_weights(self.version)  # engines start from the checkpoint's weights, not the model's
        plan = plan_resume(state, self.manager, max_token_lag=self.policy.max_token_lag,
                           group_size=self.recipe.algorithm.group_size)
        self.open_groups = plan.groups
        self.hand_out(plan.episodes)
        self.event("resumed", checkpoint=str(info.path), step=state.step, version=state.version,
                   seconds=round(time.monotonic() - started, 3), **plan.as_dict())
        print(f"resumed from {info.path.name} (step {state.step}, version {state.version}): {plan.describe()}",
              flush=True)
        return state.step + 1

    def event(self, name: str, **fields: Any) -> None:
        """One line of the run's event log (``events.jsonl``): stops, checkpoints, restarts, the end."""
        row = {"event": name, "time": time.time(), "restart": self.restart, "job": self.job_id, **fields}
        with open(RunPaths(self.run_dir).events, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def out_of_time(self) -> bool:
        wall = self.recipe.budgets.wall_minutes
        return wall is not None and time.monotonic() - self.started > wall * 60

    def finish(self) -> RunSummary:
        """The last checkpoint (at the end of the budget, or at a stop request's safe point), then every
        rank stops; a run stopped by USR1/USR2 under Slurm then requeues itself."""
        preempted = self.stopping is not None
        self.live.enter("stopping", self.step_done)
        if self.stopping is not None:
            # Checkpoint first: after a TERM, Slurm may end the step within seconds, and the trainers' state
            # is what cannot be had again. The generations cut by the quiesce reach the store afterwards.
            self.checkpoint(f"stop:{self.stopping[1]}")
            self.quiesce_rollouts()
            self.manager.flush()
        elif self.step_done > 0 and (self.last_checkpoint is None or self.last_checkpoint.step < self.step_done):
            self.checkpoint("final")  # a run that trained nothing (budgets.steps: 0) has nothing to keep
        if (self.stopping is None and self.recipe.training.export_every and self.step_done > 0
                and not RunPaths(self.run_dir).export(self.step_done).exists()):
            self.export(self.step_done)  # the final policy too
        self.stop_everyone()
        # Keep serving the trajectory manager until every rollout rank has said goodbye: episodes still in
        # flight when Stop arrives make calls that must be answered, or those ranks could never shut down.
        self._serving.join(timeout=STOP_GRACE_S)
        self._stop_serving.set()
        self._serving.join()
        if self.attached is not None:
            self.attached.close()
        self.scheduler.timeline.close()  # the timeline's last intervals go with the store's close
        self.manager.close()
        if preempted:
            self._after_stop()
        else:
            self.live.enter("finished", self.step_done)
            self.event("finished", step=self.step_done,
                       reason="steps" if self.step_done >= self.recipe.budgets.steps else "wall_minutes")
        rewards = [r["reward_mean"] for r in self.progress.rows]
        tenth = max(1, len(rewards) // 10)
        return RunSummary(len(rewards), sum(rewards[:tenth]) / tenth if rewards else 0.0,
                          sum(rewards[-tenth:]) / tenth if rewards else 0.0, self.store_path,
                          time.monotonic() - self.started, self.store.stats.seconds, self.store.stats.tokens,
                          bubble=self.scheduler.timeline.bubble())


def run_loop(ctl: Controller) -> RunSummary:
    """The RL loop: episodes -> batch -> train step -> new weights everywhere, until the budget is spent."""
    first = ctl.resume()                          # step 1, or the checkpoint's next one
    if first == 1:
        ctl.evaluate_if_due(0)                    # the initial policy on the held-out problems
    for step in range(first, ctl.recipe.budgets.steps + 1):
        started = time.monotonic()
        ctl.lend_idle_trainers(step)              # seamless: idle trainer ranks take over running episodes
        ctl.keep_rollouts_busy()                  # agents play episodes on the rollout ranks
        batch = ctl.wait_for_batch(step)          # whole GRPO groups within the staleness bound
        if batch is None:                         # a stop request came first: checkpoint now
            break
        ctl.reclaim_lent(step)                    # seamless: lent ranks back, their episodes continue elsewhere
        trained = ctl.train(step, batch)          # one optimisation step on the trainer ranks
        sync_s = ctl.sync_weights(trained.version)  # engines pause, load the new weights, resume
        step_s = time.monotonic() - started
        ctl.evaluate_if_due(step)                 # every evaluation.every steps: held-out problems, never trained
        ctl.report(step, batch, trained, sync_s, step_s)
        ctl.checkpoint_if_due(step)               # every training.checkpoint_every steps
        if ctl.out_of_time() or ctl.stop_requested():
            break
    return ctl.finish()                           # last checkpoint, every rank stops (and a requeue)


def describe(summary: RunSummary, progress: Progress, plot: Any) -> str:
    share = summary.store_seconds / max(summary.seconds, 1e-9)
    lines = [progress.curve(), *filter(None, [progress.evaluation_line()]),
             f"{summary.steps} steps in {summary.seconds:.0f} s; trajectory store: {summary.store}",
             f"store writes: {summary.store_tokens:,} tokens in {summary.store_seconds:.2f} s, "
             f"{100 * share:.2f}% of the run's wall time"]
    trained = sum(r["trained_tokens"] for r in progress.rows)
    generated = sum(r["generated_tokens"] for r in progress.rows)
    lines.append(f"end to end: {trained / max(summary.seconds, 1e-9):,.0f} trained tokens/s "
                 f"({trained:,} tokens, {generated:,} of them generated by the policy)")
    if summary.bubble is not None:
        lines.append(f"bubble fraction: {summary.bubble.format()}")
    if lending := lending_summary(progress.rows):
        lines.append(lending)
    if plot is not None:
        lines.append(f"reward plot: {plot}")
    return "\n".join(lines)


def lending_summary(rows: list[dict[str, Any]]) -> str | None:
    """seamless: the trainer ranks lent and reclaimed, and how long reclaims took (None: nothing was lent)."""
    reclaimed = [r for r in rows if "reclaim_s" in r]
    if not reclaimed:
        return None
    seconds = [float(r["reclaim_s"]) for r in reclaimed]
    return (f"seamless: {reclaimed[-1]['lends']} lendings, {reclaimed[-1]['reclaims']} reclaims; reclaim (batch ready "
            f"-> training starts) mean {sum(seconds) / len(seconds):.3f} s, max {max(seconds):.3f} s; "
            f"{sum(int(r['reclaim_moved']) for r in reclaimed)} episodes moved, "
            f"{sum(int(r['reclaim_interrupted']) for r in reclaimed)} generations cut")
