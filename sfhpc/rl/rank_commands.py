"""A worker rank's command loop: which handler answers each of the controller's commands, by the roles the
rank plays, and the one loop that runs them until Stop.

A rank plays one of five parts:

* a **trainer** (`TrainerWorker`): Train, SyncWeights (the first trainer publishes the weights),
  Checkpoint, Stop;
* a **rollout** rank (`RolloutWorker`): Play, SyncWeights (its engine takes the broadcast), Quiesce,
  Cancel, Release (some of its episodes move to a lent rank that ran dry), Stop;
* **colocated**, trainer and rollout at once: the trainer's Train and Checkpoint, the rollout's commands;
  its engine loads the weights from this very trainer, so the trainer publishes nothing; before a Train the
  engine sleeps (its GPU memory given back), and the next weight update wakes it;
* a trainer **lent** to rollout (``seamless``): the trainer's commands, then, on the same rank, the
  rollout's Play, Quiesce and Cancel, Reclaim, and a SyncWeights its engine follows after the broadcast
  (the trainer answers it; the engine's load keeps no rollout rank waiting); its engine sleeps through a
  Train as a colocated one does;
* a **teacher** (`TeacherWorker`, ``algorithm.distill``): Score, Stop.

A command some role of the rank handles goes to each such role's handler in that order; a handler's reply
(the command's own type, `sfhpc.rl.messages.REPLIES`) goes to the controller at once. Any other command is
a fault of the protocol and ends the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sfhpc.rl import messages as msg
from sfhpc.runtime import preemption
from sfhpc.runtime.comm_layout import CommLayout

if TYPE_CHECKING:
    from sfhpc.rl.rollout_worker import RolloutWorker
    from sfhpc.rl.teacher_worker import TeacherWorker
    from sfhpc.rl.trainer_worker import TrainerWorker

Handler = Callable[[Any], object]  # command -> its reply, or None where this rank does not answer


def command_table(trainer: TrainerWorker | None, rollout: RolloutWorker | None,
                  lent: bool = False, teacher: TeacherWorker | None = None) -> dict[type, tuple[Handler, ...]]:
    """Command type -> the handlers that run it on a rank with these roles (`lent`: `rollout` is the engine
    of the trainer rank `trainer`, lent to rollout now and then)."""
    table: dict[type, list[Handler]] = {}

    def on(kind: type, handler: Handler) -> None:
        table.setdefault(kind, []).append(handler)

    if teacher is not None:
        on(msg.Score, teacher.score)
        on(msg.Stop, lambda _command: None)

    colocated = trainer is not None and rollout is not None and not lent
    if trainer is not None and rollout is not None:  # the engine shares the trainer's GPU: it sleeps first
        on(msg.Train, lambda _command: rollout.sleep_engine())
    if trainer is not None:
        on(msg.Train, trainer.train)
        on(msg.Checkpoint, trainer.checkpoint)
        if not colocated:
            on(msg.SyncWeights, trainer.publish)
            on(msg.Stop, trainer.stop)
    if rollout is not None:
        r = rollout

        def sync(command: msg.SyncWeights) -> msg.Synced | None:
            seconds = r.sync_weights(command.version)
            return None if lent else msg.Synced(r.rank, command.version, seconds, restarts=r.engine_restarts,
                                                paused_at=r.paused_at)

        def stop(_command: msg.Stop) -> None:
            r.end_weight_stream()

        on(msg.Play, lambda command: r.play(command.episodes))
        on(msg.SyncWeights, sync)
        on(msg.Quiesce, lambda _command: msg.Quiesced(r.rank, r.quiesce()))
        on(msg.Cancel, lambda command: msg.Cancelled(r.rank, *r.cancel(command.groups)))
        if lent:
            on(msg.Reclaim, lambda command: msg.Reclaimed(r.rank, *r.reclaim(command.to)))
        else:
            on(msg.Release, lambda command: msg.Released(r.rank, *r.release(command.episodes, command.to)))
        on(msg.Stop, stop)
    return {kind: tuple(handlers) for kind, handlers in table.items()}


def serve(layout: CommLayout, trainer: TrainerWorker | None = None, rollout: RolloutWorker | None = None,
          lent: bool = False, teacher: TeacherWorker | None = None, notice: Any | None = None) -> None:
    """The rank's command loop (its main thread), until the controller says Stop. While it waits, a stop
    signal is passed on to the controller (`notice`: what a signal does instead, a worker of another job's
    leaving), and an episode that crashed on this rank's engine ends the run."""
    world, controller = layout.world, layout.controller_rank
    table = command_table(trainer, rollout, lent, teacher)
    notice = notice or preemption.StopNotice(world, controller)

    def idle() -> None:
        notice.check()
        if rollout is not None and (errors := rollout.errors()):
            raise errors[0]  # an agent that crashed must not go unnoticed

    while True:
        idle()
        command = msg.receive(world, controller, idle=idle)
        handlers = table.get(type(command))
        if not handlers:
            raise RuntimeError(f"rank {world.Get_rank()}: unexpected command {command!r}")
        for handle in handlers:
            reply = handle(command)
            if reply is None:
                continue
            expected = msg.REPLIES[type(command)]
            assert expected is not None and isinstance(reply, expected), f"{command!r} answered with {reply!r}"
            msg.send(world, reply, controller, msg.REPLY_TAG)
        if isinstance(command, msg.Stop):
            return
