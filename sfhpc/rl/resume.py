"""Continuing a run in a new allocation: what the controller saves, and what it does with it on restart.

The store is the record of every token; the checkpoint adds what only the controller knew: the step
and weight version, the sampler's state, and the episodes it had handed out and not yet seen trained
(`ControllerState`). On restart `plan_resume` walks those episode groups against the trajectories the
store holds (the manager reloaded them; running ones came back interrupted):

- first, every trajectory with tokens of a policy newer than the restored one is aborted and counted,
  with the rest of its episode: those weights died with the crash (a periodic checkpoint, then more
  steps), so the tokens can be neither trained on nor continued, and an episode of several agents is
  trained whole or not at all (its finished members are played again with it);
- under ``pipeline.max_token_lag``, a group whose oldest generated token is more than that many versions
  behind the restored policy is dropped whole, as stale (GRPO needs whole groups), and counted;
- otherwise the group's held trajectories are taken episode by episode (an episode of several agents holds
  one per agent), each episode matched with one of the group's hand-outs: an episode of one trajectory still
  open is *continued* from its recorded prefix on a new engine (an `EpisodeTicket` with ``resume_id``); one
  of several agents still open is aborted whole and played again (its programs' state died with the
  allocation); finished episodes wait for a batch as they are; episodes without a trajectory held (never
  started, aborted above, or trained on by the lost steps) are played again from the start, so the group is
  trained whole by the restored run; held episodes beyond the hand-outs (none should be) are aborted;
- groups the checkpoint does not know were handed out after it (the run died without a stop
  checkpoint). Their problem is not recorded, so they cannot be continued: a whole group of finished
  members, fresh for the restored policy, is trained as its own group; any other is aborted and counted.
- an evaluation's groups (`sfhpc.rl.evaluation`) still held were cut by the stop: aborted and counted (the
  evaluation is played again when its step comes round again, or not at all).

Every group kept is booked again in the manager's groups in flight. Group keys carry the store's writer
session, so the keys handed out from now on differ from every key of the lost allocation: a kept group
never takes members of a new hand-out. The consumption marks in the store decide what was trained, so no
trajectory is trained twice.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sfhpc.data.groups import hopeless, is_evaluation
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.trajectory import Status
from sfhpc.errors import SfhpcError
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.rundir import RunPaths
from sfhpc.tasks.base import Problem, Task

CONTROLLER_STATE_FORMAT = "sfhpc-controller-state"
CONTROLLER_STATE_VERSION = 1
PICKLED_STATE_FILE = "controller.pt"  # what earlier versions wrote instead; never read


@dataclasses.dataclass
class ControllerState:
    """Everything of the controller a checkpoint holds, written as JSON: a resume reads plain data only, so
    that a run folder another user can write cannot make it run code. Problems go through their task's
    `Task.problem_to_json` / `Task.problem_from_json`, the sampler's state is `Task.state` as it is."""

    step: int  # the last training step done
    version: int  # the policy version the trainers hold
    rng: Any  # random.Random state: the problems and sampling seeds still to come
    next_group: int  # the number the next GRPO group gets
    open_groups: dict[str, tuple[EpisodeTicket, ...]]  # handed out, not yet trained on or dropped
    task_state: Any = None  # a task's own sampler state (`Task.state`), e.g. a data file's position
    assigned: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> episodes sent so far

    def save(self, path: Path, task: Task) -> None:
        path.write_text(self.to_json(task), encoding="utf-8")

    def to_json(self, task: Task) -> str:
        """The state as the checkpoint's JSON text (`ControllerStateError` for what is not plain data)."""
        version, internal, gauss = self.rng
        state = {"format": CONTROLLER_STATE_FORMAT, "format_version": CONTROLLER_STATE_VERSION,
                 "step": self.step, "version": self.version, "rng": [version, list(internal), gauss],
                 "next_group": self.next_group, "task_state": self.task_state,
                 "assigned": {str(rank): count for rank, count in self.assigned.items()},
                 "open_groups": {group: [_ticket_json(t, task) for t in tickets]
                                 for group, tickets in self.open_groups.items()}}
        try:
            return json.dumps(state, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ControllerStateError(f"task {task.name or type(task).__name__}: its problems or sampler state "
                                       f"are not plain data ({exc}); see Task.problem_to_json and Task.state "
                                       "in docs/tasks-and-rewards.md") from None

    @classmethod
    def load(cls, path: Path, task: Task) -> ControllerState:
        if not path.is_file():
            if (path.parent / PICKLED_STATE_FILE).is_file():
                raise ControllerStateError(f"{path.parent}: written by an earlier sfhpc, whose controller state "
                                           "is a pickle; resume reads plain data only: start a new run")
            raise ControllerStateError(f"{path}: no such file")
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ControllerStateError(f"{path}: cannot read the controller state ({exc})") from None
        if not isinstance(state, dict) or state.get("format") != CONTROLLER_STATE_FORMAT:
            raise ControllerStateError(f"{path}: not an sfhpc controller state")
        if state.get("format_version") != CONTROLLER_STATE_VERSION:
            raise ControllerStateError(f"{path}: controller state format {state.get('format_version')} is not "
                                       f"the supported {CONTROLLER_STATE_VERSION}")
        version, internal, gauss = state["rng"]
        return cls(step=state["step"], version=state["version"], rng=(version, tuple(internal), gauss),
                   next_group=state["next_group"], task_state=state["task_state"],
                   assigned={int(rank): count for rank, count in state["assigned"].items()},
                   open_groups={group: tuple(_ticket(t, task) for t in tickets)
                                for group, tickets in state["open_groups"].items()})


class ControllerStateError(SfhpcError):
    """A controller state that cannot be written as plain data, or read back."""


def _ticket_json(ticket: EpisodeTicket, task: Task) -> dict[str, Any]:
    return {"key": ticket.problem.key, "data": task.problem_to_json(ticket.problem.data), "group": ticket.group,
            "seed": ticket.seed, "resume_id": ticket.resume_id}


def _ticket(value: dict[str, Any], task: Task) -> EpisodeTicket:
    return EpisodeTicket(Problem(value["key"], task.problem_from_json(value["data"])), value["group"],
                         value["seed"], value["resume_id"])


@dataclasses.dataclass
class ResumePlan:
    episodes: list[EpisodeTicket]  # to hand out now: continuations (resume_id set) and episodes played again
    groups: dict[str, tuple[EpisodeTicket, ...]]  # the groups of the checkpoint still out after the restart
    waiting_groups: int  # whole groups handed out after the checkpoint, finished and fresh: kept for training
    resumed: int = 0  # trajectories continued from their prefix
    replayed: int = 0  # episodes without a trajectory held, played again
    dropped_stale: int = 0  # trajectories dropped as too stale to continue or train
    dropped_newer: int = 0  # trajectories aborted for tokens of a policy newer than the restored one
    newer_tokens: int = 0  # those tokens
    abandoned: int = 0  # trajectories aborted that cannot be continued: of groups handed out after the checkpoint
    # that cannot be whole, of episodes of several agents (played again), of episodes beyond the hand-outs
    finished: int = 0  # finished trajectories waiting for a batch

    def describe(self) -> str:
        return (f"{self.resumed} trajectories continued from their prefix, {self.replayed} episodes played "
                f"again, {self.finished} finished ones waiting for a batch, {self.dropped_stale} dropped as "
                f"stale, {self.dropped_newer} dropped for {self.newer_tokens} tokens of the lost policy, "
                f"{self.abandoned} abandoned")

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in dataclasses.asdict(self).items() if isinstance(v, int)}


def plan_resume(state: ControllerState, manager: TrajectoryManager, *, max_token_lag: int | None,
                group_size: int) -> ResumePlan:
    """What to do with every group of the checkpoint and every trajectory the store holds (module docstring);
    books the groups kept in `manager`."""
    plan = ResumePlan([], {}, 0)
    plan.dropped_newer, plan.newer_tokens = manager.drop_newer(state.version)
    for group, tickets in state.open_groups.items():
        held = manager.group_episodes(group)
        oldest = [v for members in held for _, _, v in members if v is not None]
        if hopeless(state.version, min(oldest, default=None), max_token_lag):
            plan.dropped_stale += manager.drop_group(group, Status.STALE)
            continue
        # A group's episodes are alike (one problem, seeds of their own): the held episodes take the first
        # tickets, one each, however many trajectories (agents) an episode holds.
        for members, ticket in zip(held, tickets):
            still_open = [trajectory_id for trajectory_id, status, _ in members if status.is_open]
            if not still_open:
                plan.finished += len(members)
            elif len(members) == 1:
                plan.episodes.append(dataclasses.replace(ticket, resume_id=still_open[0]))
                plan.resumed += 1
            else:  # several agents' programs, whose state died with the allocation: played again whole
                for trajectory_id, _, _ in members:
                    manager.abort(trajectory_id)
                plan.abandoned += len(members)
                plan.episodes.append(ticket)
                plan.replayed += 1
        for members in held[len(tickets):]:  # more episodes than were handed out: none can be matched
            for trajectory_id, _, _ in members:
                manager.abort(trajectory_id)
            plan.abandoned += len(members)
        again = tickets[len(held):]
        plan.episodes += again
        plan.replayed += len(again)
        plan.groups[group] = tickets
        manager.book_group(group, again=True)
    for group in manager.live_groups():
        if group in state.open_groups:
            continue
        if is_evaluation(group):  # an evaluation the stop cut: it is played again whole, or not at all
            plan.abandoned += manager.drop_group(group, Status.ABORTED)
            continue
        members = manager.group_members(group)
        whole = (len(manager.group_episodes(group)) >= group_size
                 and all(status is Status.FINISHED for _, status, _ in members))
        oldest = [v for _, _, v in members if v is not None]
        if whole and hopeless(state.version, min(oldest, default=None), max_token_lag):
            plan.dropped_stale += manager.drop_group(group, Status.STALE)
        elif whole:
            manager.book_group(group, again=True)
            plan.waiting_groups += 1
            plan.finished += len(members)
        else:
            plan.abandoned += manager.drop_group(group, Status.ABORTED)
    return plan


def check_resumable(run_dir: Path, recipe: Any) -> tuple[Path, Any]:
    """Refuse, before anything starts or is written, a ``--resume`` folder that is not a run of this recipe
    with a sound checkpoint; returns the folder (absolute) and that checkpoint (a `CheckpointInfo`: its files
    are checksummed once, here)."""
    from sfhpc.errors import SfhpcError
    from sfhpc.rl.checkpoints import RunCheckpoints, check_identity, run_identity

    run_dir = run_dir.absolute()
    if not run_dir.is_dir():
        raise SfhpcError(f"--resume {run_dir}: no such folder")
    paths = RunPaths(run_dir)
    if not any(p.exists() for p in (paths.launch_report, paths.store, paths.checkpoints)):
        raise SfhpcError(f"--resume {run_dir}: not a run folder (no launch_report.json, trajectories.h5 or "
                         "checkpoints/ in it)")
    problems: list[str] = []
    info = RunCheckpoints(run_dir).latest(warn=problems.append)
    if info is None:
        detail = f" ({problems[0]})" if problems else ""
        raise SfhpcError(f"--resume {run_dir}: no complete checkpoint to continue from{detail}")
    model_dir = Path(recipe.model.path) if recipe.model.path else paths.model
    check_identity(info, run_identity(recipe, model_dir))
    return run_dir, info
