"""The controller (world rank 0): trajectory manager, HDF5 store, scheduler, and the RL loop.

The loop itself is `run_loop`, one screen long. Everything it calls is a method of `Controller`:
handing out episodes by tag, waiting for a batch of whole GRPO groups within the staleness bound,
one training step on the trainer ranks, bringing every engine to the new weights.

Modes. ``sync`` hands out exactly one step's episodes and waits for them before training (colocated,
generate-then-train). ``async`` keeps up to ``(max_staleness + 1)`` steps of episodes out, so rollout
ranks keep generating while the trainer trains; a weight update pauses the engines, and interrupted
generations continue with the new weights (partial rollout). The manager drops groups whose oldest
token is more than ``max_staleness`` versions behind the policy being trained.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import Recipe
from sfhpc.data.manager import Batch, TrajectoryManager
from sfhpc.data.service import ManagerServer
from sfhpc.data.store import TrajectoryStore
from sfhpc.launch.resolve import LaunchPlan
from sfhpc.rl import messages as msg
from sfhpc.rl.progress import Progress
from sfhpc.rl.scheduler import RankState, Scheduler
from sfhpc.runtime.comm_layout import CommLayout
from sfhpc.tasks.base import Task

STORE_NAME = "trajectories.h5"
STOP_GRACE_S = 120.0  # how long rollout ranks get to wind down their episodes after Stop


@dataclasses.dataclass(frozen=True)
class RunSummary:
    steps: int
    first_reward: float
    last_reward: float
    store: Path
    seconds: float
    store_seconds: float  # time the controller spent writing the HDF5 store (appends + flushes)
    store_tokens: int


class Controller:
    def __init__(self, recipe: Recipe, plan: LaunchPlan, layout: CommLayout, task: Task, run_dir: Path) -> None:
        self.recipe, self.layout, self.task, self.run_dir = recipe, layout, task, run_dir
        self.scheduler = Scheduler(plan)
        self.store_path = run_dir / STORE_NAME
        self.store = TrajectoryStore.open(self.store_path,
                                          run_metadata={"recipe": recipe.name, "source": recipe.source})
        self.manager = TrajectoryManager(self.store, max_staleness=recipe.pipeline.max_staleness)
        self.server = ManagerServer(self.manager, layout.manager_link, clients=self.scheduler.rollout_ranks)
        self._stop_serving = threading.Event()
        self._serving = threading.Thread(target=self.server.serve, args=(self._stop_serving,),
                                         name="sfhpc-manager", daemon=True)
        self._serving.start()
        self.rng = random.Random(recipe.seed)
        self.version = 0
        self.groups_out = 0  # GRPO groups handed out and not yet trained on or dropped as stale
        self.stale_groups = 0  # groups the manager dropped as too stale (replaced by new ones)
        self._group_ids = itertools.count()
        self.progress = Progress(run_dir, recipe.budgets.steps)
        self.started = time.monotonic()

    # -- the steps of the loop ---------------------------------------------------------------------
    def keep_rollouts_busy(self) -> None:
        """Hand out episodes: one step's worth (sync), or up to the staleness bound (async)."""
        per_step = self.recipe.budgets.prompts_per_step
        ahead = 1 if self.recipe.pipeline.mode == "sync" else self.recipe.pipeline.max_staleness + 1
        limit = per_step * ahead
        new_groups = max(0, limit - self.groups_out)
        episodes = []
        for _ in range(new_groups):
            problem = self.task.sample(self.rng)
            group = f"g{next(self._group_ids)}-{problem.key}"
            episodes += [msg.Episode(problem, group, self.rng.randrange(2**31))
                         for _ in range(self.recipe.algorithm.group_size)]
        self.groups_out += new_groups
        for rank, share in self.scheduler.assign(episodes).items():
            msg.send(self.layout.world, msg.Play(tuple(share)), rank)

    def wait_for_batch(self, step: int) -> Batch:
        """Whole, fresh groups for one step (polls the manager; stale groups are dropped and replaced)."""
        per_step, size = self.recipe.budgets.prompts_per_step, self.recipe.algorithm.group_size
        while True:
            batch = self.manager.take_batch(self.version, per_step, size, step)
            if batch is not None:
                self.groups_out -= len(batch.groups)
                return batch
            stale_groups = self.manager.counts().get("stale", 0) // size
            if stale_groups > self.stale_groups:  # replace what the staleness bound threw away
                self.groups_out -= stale_groups - self.stale_groups
                self.stale_groups = stale_groups
                self.keep_rollouts_busy()
            time.sleep(0.005)

    def train(self, step: int, batch: Batch) -> msg.Trained:
        from sfhpc.trainer.batch import TrainBatch

        command = msg.Train(step, TrainBatch.from_trajectories(batch.trajectories))
        trainers = self.scheduler.trainer_ranks
        self.scheduler.set_state(trainers, RankState.TRAINING)
        for rank in trainers:
            msg.send(self.layout.world, command, rank)
        reply = msg.receive(self.layout.world, trainers[0], msg.REPLY_TAG)
        self.scheduler.set_state(trainers, RankState.IDLE)
        return reply

    def sync_weights(self, version: int) -> float:
        """Every engine to `version`; returns the longest pause a rollout rank saw."""
        rollouts, trainers = self.scheduler.rollout_ranks, self.scheduler.trainer_ranks
        everyone = sorted(set(rollouts) | set(trainers))
        self.scheduler.set_state(everyone, RankState.SYNCING)
        for rank in everyone:
            msg.send(self.layout.world, msg.SyncWeights(version), rank)
        answering = list(rollouts) + ([trainers[0]] if trainers[0] not in rollouts else [])
        replies = [msg.receive(self.layout.world, rank, msg.REPLY_TAG) for rank in answering]
        self.scheduler.set_state(everyone, RankState.IDLE)
        self.version = version
        return max(r.seconds for r in replies if r.rank in rollouts)

    def report(self, step: int, batch: Batch, trained: msg.Trained, sync_s: float, step_s: float) -> None:
        rewards = [t.reward or 0.0 for t in batch.trajectories]
        metrics = trained.metrics
        self.progress.step({
            "step": step, "version": trained.version, "reward_mean": sum(rewards) / len(rewards),
            "trajectories": len(rewards), "generated_tokens": batch.num_generated, "trained_tokens": batch.num_tokens,
            "generated_tokens_per_s": batch.num_generated / step_s, "trained_tokens_per_s":
            batch.num_tokens / max(float(metrics.get("seconds", 0.0)), 1e-9),
            "train_s": float(metrics.get("seconds", 0.0)), "sync_s": sync_s,
            "step_s": step_s, **{k: metrics[k] for k in ("loss", "mean_ratio", "clip_fraction", "mean_staleness",
                                                          "max_staleness") if k in metrics},
        })

    def checkpoint(self, step: int, *, final: bool = False) -> Path | None:
        """Trainer state to ``checkpoints/step-NNNNNN.pt`` every ``training.checkpoint_every`` steps and at
        the end (the trainers write it atomically; trainer 0 answers when it is on disk)."""
        every = self.recipe.training.checkpoint_every
        if not final and not (every and step % every == 0):
            return None
        path = self.run_dir / "checkpoints" / f"step-{step:06d}.pt"
        trainers = self.scheduler.trainer_ranks
        for rank in trainers:
            msg.send(self.layout.world, msg.Checkpoint(str(path)), rank)
        msg.receive(self.layout.world, trainers[0], msg.REPLY_TAG)
        return path

    def out_of_time(self) -> bool:
        wall = self.recipe.budgets.wall_minutes
        return wall is not None and time.monotonic() - self.started > wall * 60

    def finish(self) -> RunSummary:
        for rank in range(1, self.layout.world.Get_size()):
            msg.send(self.layout.world, msg.Stop(), rank)
        # Keep serving the trajectory manager until every rollout rank has said goodbye: episodes still in
        # flight when Stop arrives make calls that must be answered, or those ranks could never shut down.
        self._serving.join(timeout=STOP_GRACE_S)
        self._stop_serving.set()
        self._serving.join()
        self.manager.close()
        rewards = [r["reward_mean"] for r in self.progress.rows]
        tenth = max(1, len(rewards) // 10)
        return RunSummary(len(rewards), sum(rewards[:tenth]) / tenth if rewards else 0.0,
                          sum(rewards[-tenth:]) / tenth if rewards else 0.0, self.store_path,
                          time.monotonic() - self.started, self.store.stats.seconds, self.store.stats.tokens)


def run_loop(ctl: Controller) -> RunSummary:
    """The RL loop: episodes -> batch -> train step -> new weights everywhere, until the budget is spent."""
    for step in range(1, ctl.recipe.budgets.steps + 1):
        started = time.monotonic()
        ctl.keep_rollouts_busy()                  # agents play episodes on the rollout ranks
        batch = ctl.wait_for_batch(step)          # whole GRPO groups within the staleness bound
        trained = ctl.train(step, batch)          # one optimisation step on the trainer ranks
        sync_s = ctl.sync_weights(trained.version)  # engines pause, load the new weights, resume
        ctl.report(step, batch, trained, sync_s, time.monotonic() - started)
        ctl.checkpoint(step)                      # every training.checkpoint_every steps
        if ctl.out_of_time():
            break
    ctl.checkpoint(step, final=True)
    return ctl.finish()


def describe(summary: RunSummary, progress: Progress, plot: Any) -> str:
    share = summary.store_seconds / max(summary.seconds, 1e-9)
    lines = [progress.curve(), f"{summary.steps} steps in {summary.seconds:.0f} s; trajectory store: {summary.store}",
             f"store writes: {summary.store_tokens:,} tokens in {summary.store_seconds:.2f} s, "
             f"{100 * share:.2f}% of the run's wall time"]
    trained = sum(r["trained_tokens"] for r in progress.rows)
    generated = sum(r["generated_tokens"] for r in progress.rows)
    lines.append(f"end to end: {trained / max(summary.seconds, 1e-9):,.0f} trained tokens/s "
                 f"({trained:,} tokens, {generated:,} of them generated by the policy)")
    if plot is not None:
        lines.append(f"reward plot: {plot}")
    return "\n".join(lines)
