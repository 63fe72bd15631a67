"""Every communicator of a run, built once from the world communicator and the rank table.

Nothing else in sfhpc calls ``Split``. The layout is validated when it is built and printed at start:

* ``world``            every rank of every het component (Slurm: one ``srun --mpi=pmix`` step);
* ``trainers``         the ranks with the trainer role (data-parallel training, DDP over gloo);
* ``rollouts``         the ranks with the rollout role (inference engines + agent endpoints);
* ``weight_broadcast`` the first trainer rank (root, rank 0 in this communicator) and every rollout
  rank that does not train (a rank that also trains loads its own trainer's weights): new weights are
  broadcast over it;
* ``teachers``         no communicator: the ranks with the teacher role (``algorithm.distill``) each score
  their share of a batch for the controller, which sends it point-to-point over ``world``;
* ``manager_link``     a duplicate of ``world`` that carries only the trajectory manager's requests
  (the controller serves them in a thread of its own, so they must not mix with control messages); a
  trainer rank lent to rollout (``seamless``) records its episodes over it like a rollout rank, while
  its trainer's collectives stay on ``trainers``: the two never wait on each other;
* the controller is world rank 0 and sends its commands point-to-point over ``world``.

A rank outside a group holds ``None`` for that group's communicator.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.table import format_table

CONTROLLER_RANK = 0


@dataclasses.dataclass(frozen=True)
class CommLayout:
    world: Any
    manager_link: Any
    trainers: Any | None
    rollouts: Any | None
    weight_broadcast: Any | None
    trainer_ranks: tuple[int, ...]        # world ranks, in communicator order
    rollout_ranks: tuple[int, ...]
    broadcast_ranks: tuple[int, ...]      # world ranks; the first is the root
    teacher_ranks: tuple[int, ...] = ()   # world ranks that score tokens for distillation
    controller_rank: int = CONTROLLER_RANK

    @property
    def weight_root(self) -> int:
        """World rank that sends new weights (the first trainer)."""
        return self.broadcast_ranks[0]

    def describe(self) -> str:
        rows = [("world", str(self.world.Get_size()), "all"),
                ("manager_link", str(self.world.Get_size()), "all (trajectory manager requests)"),
                ("controller", "1", str(self.controller_rank)),
                ("trainers", str(len(self.trainer_ranks)), _ranks(self.trainer_ranks)),
                ("rollouts", str(len(self.rollout_ranks)), _ranks(self.rollout_ranks)),
                ("weight_broadcast", str(len(self.broadcast_ranks)),
                 f"root {self.weight_root} -> {_ranks(self.broadcast_ranks[1:]) or 'none'}")]
        if self.teacher_ranks:
            rows.append(("teachers", str(len(self.teacher_ranks)), f"{_ranks(self.teacher_ranks)} (no communicator)"))
        return "communicators:\n" + format_table(("name", "size", "world ranks"), rows, indent="  ")


def _ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)


def build_comm_layout(world: Any, plan: LaunchPlan) -> CommLayout:
    """Split `world` by the roles of the plan's rank table (collective: every rank calls it)."""
    from mpi4py import MPI

    slots = plan.ranks()
    if world.Get_size() != len(slots):
        raise SfhpcError(f"the MPI world has {world.Get_size()} ranks, the plan {len(slots)}")
    controllers = [s.rank for s in slots if "controller" in s.roles]
    trainers = tuple(s.rank for s in slots if "trainer" in s.roles)
    rollouts = tuple(s.rank for s in slots if "rollout" in s.roles)
    teachers = tuple(s.rank for s in slots if "teacher" in s.roles)
    if controllers != [CONTROLLER_RANK]:
        raise SfhpcError(f"the controller must be world rank {CONTROLLER_RANK} alone, found ranks {controllers}")
    if not trainers or not rollouts:
        raise SfhpcError("a run needs at least one trainer rank and one rollout rank")
    broadcast = (trainers[0], *(r for r in rollouts if r not in trainers))
    me = world.Get_rank()

    def split(members: tuple[int, ...]) -> Any | None:
        # key = position in `members`, so communicator ranks follow the order given (root first).
        color = 0 if me in members else MPI.UNDEFINED
        comm = world.Split(color, members.index(me) if me in members else 0)
        return None if comm == MPI.COMM_NULL else comm

    layout = CommLayout(world, world.Dup(), split(trainers), split(rollouts), split(broadcast), trainers, rollouts,
                        broadcast, teachers)
    for comm, members in ((layout.trainers, trainers), (layout.rollouts, rollouts),
                          (layout.weight_broadcast, broadcast)):
        if comm is not None:
            assert comm.Get_size() == len(members) and comm.Get_rank() == members.index(me)
    return layout
