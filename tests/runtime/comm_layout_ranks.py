"""Run under mpiexec: build the CommLayout of a recipe and check every communicator with real traffic."""

import json
import sys


def main() -> None:
    from mpi4py import MPI

    from sfhpc.config import load_recipe
    from sfhpc.plan.local_map import local_cluster_map
    from sfhpc.plan.resolve import resolve
    from sfhpc.runtime.comm_layout import build_comm_layout

    recipe = load_recipe(sys.argv[1])
    layout = build_comm_layout(MPI.COMM_WORLD, resolve(recipe, local_cluster_map(recipe)))
    me = MPI.COMM_WORLD.Get_rank()
    seen = {}
    for name in ("trainers", "rollouts", "weight_broadcast"):
        comm = getattr(layout, name)
        # allgather of world ranks proves who is in the group; bcast proves the root.
        seen[name] = None if comm is None else {"members": comm.allgather(me), "root": comm.bcast(me, root=0)}
    everything = MPI.COMM_WORLD.gather(seen, root=0)
    if me == 0:
        print(layout.describe(), file=sys.stderr)
        print(json.dumps(everything))


if __name__ == "__main__":
    main()
