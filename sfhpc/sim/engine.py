"""A simulated inference engine: one continuous batch, decoded under processor sharing.

Every sequence in the batch gets one token per decode step, and a step of ``b`` sequences takes
``base + b * per_sequence`` seconds (`sfhpc.sim.cost_model.DeviceCosts`). The engine keeps a virtual
clock `v`: the tokens each running sequence has received since the engine started. A sequence admitted at
``v0`` with ``n`` tokens to go ends at ``v0 + n`` on that clock whatever happens to the batch meanwhile, so
only sequence ends are events (never single tokens): the next one is the smallest end in a heap, and its
wall time follows from the current step time. Prefill is charged as extra tokens at admission (the
prefill seconds at the step time of the moment), as a chunked prefill shares the engine's steps.

An engine that is not `available` (asleep on a trainer GPU, waking, or paused for a weight update) keeps
its sequences where they are and runs nothing. A weight update cuts the running ones (`pause(cut=True)`):
they continue from their prefix under the new weights, prefilled again, as a run's engines continue them.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable

from sfhpc.sim.clock import EventQueue
from sfhpc.sim.cost_model import DeviceCosts
from sfhpc.sim.workload import Sample


class SimEngine:
    __slots__ = ("rank", "gpu", "clock", "base", "per", "prefill", "max_batch", "running", "waiting", "v", "t",
                 "available", "epoch", "generating_s", "on_turn_end", "on_busy_change", "version")

    def __init__(self, rank: int, gpu: str, costs: DeviceCosts, clock: EventQueue,
                 on_turn_end: Callable[[Sample, SimEngine], None], *, available: bool = True,
                 on_busy_change: Callable[[SimEngine, bool], None] | None = None) -> None:
        self.rank, self.gpu, self.clock = rank, gpu, clock
        self.base, self.per = costs.decode_base_s, costs.decode_per_sequence_s
        self.prefill, self.max_batch = costs.prefill_per_token_s, costs.max_batch
        self.running: list[tuple[float, int, Sample]] = []  # (end on the virtual clock, sample id, sample)
        self.waiting: deque[Sample] = deque()               # admitted, no room in the batch yet
        self.v = 0.0
        self.t = 0.0
        self.available = available
        self.epoch = 0              # bumps whenever the scheduled next end is no longer valid
        self.generating_s = 0.0     # wall time with at least one sequence decoding
        self.on_turn_end = on_turn_end
        self.on_busy_change = on_busy_change
        self.version = 0            # the policy version of the engine's weights

    @property
    def busy(self) -> bool:
        return self.available and bool(self.running)

    @property
    def holds(self) -> int:
        return len(self.running) + len(self.waiting)

    def _advance(self) -> None:
        now = self.clock.now
        if self.running and self.available:
            dt = now - self.t
            self.v += dt / (self.base + len(self.running) * self.per)
            self.generating_s += dt
        self.t = now

    def _reschedule(self) -> None:
        self.epoch += 1
        if self.running and self.available:
            step = self.base + len(self.running) * self.per
            self.clock.at(self.t + (self.running[0][0] - self.v) * step, self._on_end, self.epoch)

    def _fill(self) -> None:
        if not self.available:
            return
        running, waiting = self.running, self.waiting
        while waiting and len(running) < self.max_batch:
            sample = waiting.popleft()
            step = self.base + (len(running) + 1) * self.per
            sample.finish_v = self.v + sample.remaining + sample.context * self.prefill / step
            sample.context = 0
            group = sample.group
            if sample.first_version < 0:
                sample.first_version = self.version
                if group.oldest_version is None or self.version < group.oldest_version:
                    group.oldest_version = self.version
            heapq.heappush(running, (sample.finish_v, sample.id, sample))

    def _changed(self, was_busy: bool) -> None:
        self._reschedule()
        if self.on_busy_change is not None and was_busy != self.busy:
            self.on_busy_change(self, self.busy)

    def admit(self, samples: Iterable[Sample]) -> None:
        was_busy = self.busy
        self._advance()
        for sample in samples:
            sample.rank = self.rank
            self.waiting.append(sample)
        self._fill()
        self._changed(was_busy)

    def _on_end(self, epoch: int) -> None:
        if epoch != self.epoch:
            return  # the batch changed since this end was scheduled
        self._advance()
        ended = []
        limit = self.v + 1e-9
        running = self.running
        while running and running[0][0] <= limit:
            ended.append(heapq.heappop(running)[2])
        self._fill()
        self._changed(True)
        for sample in ended:
            sample.remaining = 0.0
            self.on_turn_end(sample, self)

    def pause(self, *, cut: bool = False) -> None:
        """Stop decoding (a weight update, or the engine goes to sleep); sequences stay. With `cut` (a weight
        update, as a run's engines take one) the running ones are cut at a token boundary and continue from
        their prefix once it resumes, prefilling their whole context again: the keys and values the engine
        held were the old weights'."""
        if self.available:
            self._advance()
            was_busy = bool(self.running)
            self.available = False
            if cut:
                self.waiting.extendleft(reversed(self._interrupt(self.running)))
                self.running = []
            self._changed(was_busy)

    def resume(self) -> None:
        if not self.available:
            self.t = self.clock.now
            self.available = True
            self._fill()
            self._changed(False)

    def evict(self) -> list[Sample]:
        """Take every sequence off the engine (interrupted at a token boundary): each keeps the tokens it
        generated, and what it must prefill where it continues (its whole context so far)."""
        was_busy = self.busy
        self._advance()
        out = self._interrupt(self.running)
        out.extend(self.waiting)
        self.running = []
        self.waiting.clear()
        self._changed(was_busy)
        return out

    def take(self, sample_ids: set[int]) -> list[Sample]:
        """Take these running sequences off the engine (as `evict` does), the others go on."""
        was_busy = self.busy
        self._advance()
        keep = [entry for entry in self.running if entry[1] not in sample_ids]
        out = self._interrupt([entry for entry in self.running if entry[1] in sample_ids])
        heapq.heapify(keep)
        self.running = keep
        self._fill()
        self._changed(was_busy)
        return out

    def _interrupt(self, entries: list[tuple[float, int, Sample]]) -> list[Sample]:
        out = []
        for end, _, sample in entries:
            left = min(sample.remaining, max(0.0, end - self.v))
            done = int(sample.remaining - left)
            sample.generated += done
            sample.remaining -= done
            sample.context = sample.context_tokens()
            out.append(sample)
        return out
