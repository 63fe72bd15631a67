"""Run under mpiexec with 3 ranks: the heartbeats of `sfhpc.runtime.liveness` over real MPI, with a clock
the script sets, so that silence is a number, not a wait. Rank 0 prints what each rank saw (JSON)."""

import json
import time


def main() -> None:
    from mpi4py import MPI

    from sfhpc.runtime.liveness import Heartbeats

    world = MPI.COMM_WORLD
    me = world.Get_rank()
    now = [100.0]
    labels = {0: "rank 0 (controller, node a)", 1: "rank 1 (trainer, node a)", 2: "rank 2 (rollout, node b)"}
    beats = Heartbeats(world, labels, 10.0, clock=lambda: now[0])
    seen: dict = {"peers": list(beats.peers), "bound": beats.bound}

    def hear_until(done, seconds: float = 5.0) -> None:
        deadline = time.monotonic() + seconds
        beats.hear()
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)
            beats.hear()

    beats.beat()
    world.Barrier()
    now[0] = 101.0
    hear_until(lambda: all(t == 101.0 for t in beats.last_heard.values()))
    seen["heard"] = dict(beats.last_heard)
    now[0] = 115.5  # 14.5 s without a beat
    seen["silent"] = beats.silent()
    if me == 0:
        seen["line"] = beats.describe(seen["silent"])
    beats.hear()  # this thread itself did not run for 14.5 s: the silence is its own
    seen["silent_after_own_gap"] = beats.silent()
    world.Barrier()
    if me == 1:  # rank 1's program ended well: it says goodbye, and leaves once the controller saw it off
        started = time.monotonic()
        seen["seen_off"] = beats.finish(bound_s=30.0)
        seen["left_after_s"] = time.monotonic() - started
    if me == 0:
        now[0] = 116.0
        hear_until(lambda: 1 not in beats.last_heard)  # hears the goodbye, sees rank 1 off
    world.Barrier()
    if me == 0:
        now[0] = 127.0
        seen["silent_after_goodbye"] = beats.silent()
        seen["beats_after_goodbye"] = beats.beat()  # none to rank 1, which may have exited
    everyone = world.gather(seen, root=0)
    if me == 0:
        print(json.dumps(everyone))
    world.Barrier()  # rank 0 heard what it listened for: the goodbyes may go now
    if me != 1:
        # Ranks 0 and 2 say goodbye to each other at once: each hears the other's, neither waits to be seen off.
        ended = beats.finish(bound_s=30.0)
        assert ended, f"rank {me} left without every peer's goodbye"


if __name__ == "__main__":
    main()
