"""Liveness: every rank shows it is alive; silence past a bound ends the run, naming the silent ranks.

A rank that dies is noticed by its launcher (mpiexec, ``srun --kill-on-bad-exit``). A rank that stops
(a SIGSTOP, a process stuck in the kernel, a node cut off) is not: the controller would wait for its
answer, a training step, a weight update, a checkpoint, until the allocation ends.

So while a rank's program runs (`watched`), one small daemon thread per rank keeps the beat, whatever the
rank's main thread is doing (a long training step or a large checkpoint is not silence):

* every rank other than the controller sends the controller a tiny message on `HEARTBEAT_TAG` every
  `INTERVAL_S`, and the controller sends every other rank one;
* the controller's thread reports the ranks it has heard nothing from for ``budgets.heartbeat_timeout_s``,
  in one line, and ends the run through the fault path (`sfhpc.runtime.fault`: every rank down, exit
  code 1, a fault a requeue may get past); the other ranks watch the controller the same way (the first
  of them reports it; the rest later, should that one be gone too).

A rank whose program ends says goodbye, so that a rank that finished is not taken for a silent one
while the controller still writes its store; and from then on nothing is sent to it. A beat sent to a
rank that has exited fails in Open MPI's TCP transport ("writev failed: Broken pipe"), which then retries
the connection and holds the sender's ``MPI_Finalize`` for minutes: a loaded machine showed a finished
run's controller hang so, beating every second to ranks that had left while it wrote its store. So a
rank hears before it beats, beats only to peers that have not said goodbye, and does not leave while a
beat may still be on its way to it: a rank that hears a goodbye sees the leaver off (one last message,
sent while the leaver still listens for it, and nothing after it), and a leaver listens until each peer
has said goodbye too or seen it off. MPI delivers a peer's earlier beats before either (messages between
two ranks on one tag do not overtake each other), so nothing can reach the leaver after it leaves. (This
had been a fixed linger of a beat and a half after the goodbye, on every rank at every run's end.)

A watcher that did not run itself for a while (the whole job suspended and resumed, a starved process)
would see silence of its own making: everyone gets a fresh bound then.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sfhpc.errors import SfhpcError
from sfhpc.runtime import fault

HEARTBEAT_TAG = 0x5F23  # every rank <-> the controller, on the world communicator
INTERVAL_S = 1.0  # the recipe's bound is at least 3 s (sfhpc.config.recipe.Budgets): a beat or two late is jitter
HEAR_EVERY_S = 0.25  # how often a rank takes what arrived: a leaver waits this long, about, to be seen off
BACKUP_DELAY_S = 15.0  # ranks after the first one report a silent controller only this much later
_ALIVE, _GOODBYE, _SEEN_OFF = 1, 0, 2


class RanksSilent(SfhpcError):
    """Ranks sent no heartbeat for longer than the bound. A fault, not a user error (exit code 1): a
    hung node or process need not hang again, so a step guard may requeue the job."""

    exit_code = fault.FAULT_EXIT


class Heartbeats:
    """One rank's side: beats to its peers (the controller: every rank; any other rank: the controller),
    and the last time each peer was heard from."""

    def __init__(self, world: Any, labels: Mapping[int, str], timeout_s: float, *, controller_rank: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.world, self.labels, self.timeout_s, self.clock = world, labels, timeout_s, clock
        self.rank = world.Get_rank()
        workers = [r for r in range(world.Get_size()) if r != controller_rank]
        self.peers = tuple(workers) if self.rank == controller_rank else (controller_rank,)
        # Ranks after the first one give the first the time to report a silent controller alone.
        first = self.rank == controller_rank or self.rank == workers[0]
        self.bound = timeout_s if first else timeout_s + BACKUP_DELAY_S
        now = clock()
        self.last_heard = dict.fromkeys(self.peers, now)
        self._last_tick = now
        self._sends: list[Any] = []
        self._leaving = False  # this rank said goodbye

    def beat(self, kind: int = _ALIVE) -> list[int]:
        """Send one heartbeat (or the goodbye) to every peer that has not said goodbye; never waits for a
        receiver. Returns the peers it went to."""
        self._sends = [request for request in self._sends if not request.Test()]
        listening = [peer for peer in self.peers if peer in self.last_heard]
        for peer in listening:
            self._sends.append(self.world.isend(kind, dest=peer, tag=HEARTBEAT_TAG))
        return listening

    def hear(self) -> None:
        """Take every heartbeat that arrived; a peer that said goodbye is no longer watched, and is seen off
        (unless this rank said goodbye to it first, which the peer then hears instead)."""
        from mpi4py import MPI

        now = self.clock()
        if now - self._last_tick > self.timeout_s / 2:
            # This thread itself did not run for that long: the silence would be its own.
            self.last_heard = dict.fromkeys(self.last_heard, now)
        self._last_tick = now
        status = MPI.Status()
        while (message := self.world.improbe(source=MPI.ANY_SOURCE, tag=HEARTBEAT_TAG, status=status)) is not None:
            kind, peer = message.recv(), status.Get_source()
            if kind in (_GOODBYE, _SEEN_OFF):
                listening = self.last_heard.pop(peer, None) is not None
                if kind == _GOODBYE and listening and not self._leaving:
                    self._sends.append(self.world.isend(_SEEN_OFF, dest=peer, tag=HEARTBEAT_TAG))
            elif peer in self.last_heard:
                self.last_heard[peer] = now

    def silent(self) -> dict[int, float]:
        """Peer -> seconds of silence, for the peers silent past the bound."""
        now = self.clock()
        return {peer: now - heard for peer, heard in sorted(self.last_heard.items()) if now - heard > self.bound}

    def describe(self, silent: Mapping[int, float]) -> str:
        ranks = ", ".join(f"{self.labels.get(peer, f'rank {peer}')} for {seconds:.0f} s"
                          for peer, seconds in silent.items())
        logs = ", ".join(f"logs/rank-{peer:03d}.log" for peer in silent)
        return (f"no heartbeat from {ranks} (budgets.heartbeat_timeout_s = {self.timeout_s:g}): the process is "
                f"stopped, stuck or cut off from the others; see {logs} in the run folder, and the node; raise "
                "budgets.heartbeat_timeout_s if a rank may hold Python's interpreter lock that long on purpose")

    def finish(self, bound_s: float | None = None) -> bool:
        """Say goodbye to the peers still listening, then listen until each has said goodbye too or seen this
        rank off, so that no beat can reach it once it has left (MPI finalises after this). Returns whether
        every peer did; after `bound_s` (the silence bound: a peer that quiet is gone or hung) it leaves
        anyway."""
        self.hear()
        self.beat(_GOODBYE)
        self._leaving = True
        deadline = time.monotonic() + (self.bound if bound_s is None else bound_s)
        while True:
            self._sends = [request for request in self._sends if not request.Test()]
            self.hear()
            if not self.last_heard and not self._sends:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


@contextlib.contextmanager
def watched(world: Any, labels: Mapping[int, str], timeout_s: float, *,
            interval_s: float = INTERVAL_S) -> Iterator[None]:
    """Keep this rank's heartbeat (and its watch: silence ends the run) while the block runs; `labels`
    names each world rank (`sfhpc.runtime.fault.describe_rank`)."""
    beats = Heartbeats(world, labels, timeout_s)
    stop = threading.Event()

    def keep() -> None:
        next_beat = time.monotonic() + interval_s
        while not stop.wait(min(HEAR_EVERY_S, interval_s)):
            beats.hear()  # first: a peer that said goodbye gets no more beats (and is seen off soon)
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + interval_s
            beats.beat()
            if silent := beats.silent():
                fault.fail(RanksSilent(beats.describe(silent)))

    thread = threading.Thread(target=keep, name="sfhpc-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    beats.finish()  # only when the program ended well: a failing rank is about to end every rank
