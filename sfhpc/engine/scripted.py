"""A deterministic CPU engine for tests and wiring. It is not a language model.

`ScriptedEngine` implements the whole `RolloutEngine` contract for real — token-by-token async
generation, pause/resume/abort, weight loads that change what it generates and bump the version — so
the endpoint, the trajectory manager and the schedulers can be exercised without vLLM. Its "model" is
a hash: the logits at a position are pseudo-random normals keyed by the weights, the position and the
last few tokens. Logprobs are real (a log-softmax over its small output vocabulary), so they are
consistent with what it samples.

Its weights are two named values: ``seed`` (int) picks the hash, ``scale`` (float) sharpens or flattens
the logits. In an RL run (``engine: {name: test}``) it is sent the policy's real tensors instead: their
digest becomes the seed, so every new version generates differently, as a model would. A per-token delay
makes generation slow enough for pauses and stop signals to land mid-generation. ``cut_after`` makes a
weight update cut replies at a known token, whatever the machine's speed: a reply that starts under weights
of version 1 or later stops after that many tokens and waits for the next pause, which ends it there with
``abort`` (its continuation, resubmitted from prompt + partial, is not held again). Version 0 is never held,
so the first batch always completes; a hold gives up after ``cut_hold_s``, so no run can wait on it forever.

Timing model. With the delays of a cost model (`sfhpc.sim.cost_model`) the engine stands in for a
GPU engine's *speed* while its text stays a hash: a decode step of a batch costs ``token_delay +
per_sequence_delay * in_flight`` (memory-bound decoding: every sequence in flight gets one token per
step, and each one makes the step a little longer), a request's prompt costs ``prefill_delay`` per token
before its first token, and a weight load pauses generation for ``load_delay``. Compute is modelled;
the streaming, pausing, interrupting and the versions of the tokens are the engine's real ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import struct
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from sfhpc.engine import tokenizer as tok
from sfhpc.engine.base import FinishReason, GenerationChunk, GenerationRequest, RolloutEngine

# Lower-case letters, space and the chat end marker: text that survives decode -> encode unchanged,
# with a chance to stop on its own.
DEFAULT_VOCAB: tuple[int, ...] = (*range(ord("a"), ord("z") + 1), ord(" "), tok.END)


class ScriptedEngine(RolloutEngine):
    """Test/CPU engine: a seeded next-token function with real sampling semantics (see module doc)."""

    def __init__(self, *, seed: int = 0, scale: float = 3.0, vocab: Sequence[int] = DEFAULT_VOCAB,
                 window: int = 8, token_delay: float = 0.0, max_model_len: int = 256, name: str = "scripted",
                 version: int = 0, per_sequence_delay: float = 0.0, prefill_delay: float = 0.0,
                 load_delay: float = 0.0, cut_after: int = 0, cut_hold_s: float = 60.0) -> None:
        super().__init__(name, version=version)
        if len(set(vocab)) != len(vocab) or len(vocab) < 2:
            raise ValueError("vocab must hold at least two distinct token ids")
        self.vocab = tuple(vocab)
        self.window = window
        self.token_delay = token_delay
        self.per_sequence_delay, self.prefill_delay, self.load_delay = per_sequence_delay, prefill_delay, load_delay
        self._seed = seed
        self._scale = scale
        self._max_model_len = max_model_len
        self._active: set[str] = set()
        self._produced: dict[str, int] = {}  # tokens each request in flight has generated
        self._aborted: set[str] = set()
        self._unseeded = random.Random()
        self.cut_after, self.cut_hold_s = cut_after, cut_hold_s
        self._cut_contexts: set[tuple[int, ...]] = set()  # prompt + partial of every request a pause ended

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def in_flight(self) -> int:
        """Requests whose stream has not ended yet."""
        return len(self._active)

    @property
    def fewest_generated(self) -> int:
        """The fewest tokens any request in flight has generated so far (0 with none in flight): what a test
        waits for before it cuts every request mid-reply, whatever the machine's speed."""
        return min(self._produced.values(), default=0)

    # -- the "model" ---------------------------------------------------------------------------
    def logits(self, context: Sequence[int]) -> list[float]:
        """Logits over ``vocab`` after `context`: a function of the weights, the position and the last
        ``window`` tokens only."""
        key = _digest(self._seed, len(context), context[-self.window:])
        rng = random.Random(key)
        return [self._scale * rng.gauss(0.0, 1.0) for _ in self.vocab]

    def next_token_logprobs(self, context: Sequence[int], temperature: float = 1.0) -> dict[int, float]:
        """Log-probabilities of each output token after `context` at `temperature` (0 counts as 1)."""
        return dict(zip(self.vocab, _log_softmax(self.logits(context), temperature or 1.0)))

    def _sample(self, context: Sequence[int], request: GenerationRequest) -> tuple[int, float]:
        temperature = request.temperature or 1.0
        logprobs = _log_softmax(self.logits(context), temperature)
        order = sorted(range(len(self.vocab)), key=lambda i: (-logprobs[i], self.vocab[i]))
        if request.temperature == 0:
            best = order[0]
            return self.vocab[best], logprobs[best]
        # Nucleus: the most likely tokens whose mass reaches top_p, renormalised.
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += math.exp(logprobs[i])
            if mass >= request.top_p:
                break
        # A seeded draw depends on the seed and the whole context, so a resubmitted continuation draws
        # what the uninterrupted request would have drawn.
        rng = random.Random(_digest(request.seed, len(context), context)) if request.seed is not None \
            else self._unseeded
        target, acc = rng.random() * mass, 0.0
        for i in kept:
            acc += math.exp(logprobs[i])
            if acc >= target:
                return self.vocab[i], logprobs[i]
        return self.vocab[kept[-1]], logprobs[kept[-1]]

    def step_delay(self) -> float:
        """Seconds until the next token of every request in flight: the timing model's decode step."""
        return self.token_delay + self.per_sequence_delay * len(self._active)

    # -- the engine ----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if request.request_id in self._active:
            raise ValueError(f"request id {request.request_id!r} is already generating on '{self.name}'")
        await self.wait_resumed()
        epoch = self.pauses
        rid = request.request_id
        self._active.add(rid)
        self._produced[rid] = 0
        context = list(request.prompt_token_ids)
        budget = min(request.max_new_tokens, self._max_model_len - len(context))
        stop = set(request.stop_token_ids)
        produced = 0
        # A continuation's prompt is a cut request's prompt + partial: it runs on, or no reply would finish.
        hold = self.cut_after > 0 and self.version >= 1 and tuple(context) not in self._cut_contexts
        try:
            if budget <= 0:
                yield GenerationChunk(rid, (), (), (), "length")
                return
            if self.prefill_delay:
                await asyncio.sleep(self.prefill_delay * len(context))
            while True:
                await asyncio.sleep(self.step_delay())  # also yields to other requests when the delay is 0
                if hold and produced == self.cut_after:
                    await self._hold_until_pause(epoch)
                # No await between this check and the sample: once pause() returned, no old request
                # produces a token, and every token carries the version that really produced it.
                if self.paused or self.pauses != epoch or rid in self._aborted:
                    if self.cut_after:
                        self._cut_contexts.add(tuple(context))
                    yield GenerationChunk(rid, (), (), (), "abort")
                    return
                token, logprob = self._sample(context, request)
                context.append(token)
                produced += 1
                self._produced[rid] = produced
                finish: FinishReason | None = None
                if token in stop:
                    finish = "stop"
                elif produced >= budget:
                    finish = "length"
                yield GenerationChunk(rid, (token,), (logprob,), (self.version,), finish)
                if finish is not None:
                    return
        finally:
            self._active.discard(rid)
            self._produced.pop(rid, None)
            self._aborted.discard(rid)

    async def _hold_until_pause(self, epoch: int) -> None:
        """Wait at the cut token until a pause (or `cut_hold_s`), polling: a pause only bumps a counter."""
        deadline = asyncio.get_running_loop().time() + self.cut_hold_s
        while self.pauses == epoch and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def abort(self, request_id: str) -> None:
        if request_id in self._active:
            self._aborted.add(request_id)

    async def _pause_generation(self) -> None:
        # Streams notice the new pause count at their next token; nothing to do here.
        return

    async def _resume_generation(self) -> None:
        return

    async def load_weights(self, weights: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        if self.load_delay:
            await asyncio.sleep(self.load_delay)  # the timing model's pause for a version's load, once per version
        return await super().load_weights(weights, version=version)

    async def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        named = dict(weights)
        if "seed" in named or "scale" in named:
            unknown = set(named) - {"seed", "scale"}
            if unknown:
                raise ValueError(f"scripted engine weights are 'seed' and 'scale', found {sorted(unknown)}")
            self._seed = int(named.get("seed", self._seed))
            self._scale = float(named.get("scale", self._scale))
            return
        # A policy's tensors (one bucket of a broadcast at a time): a few values of each are enough to tell
        # versions apart, and reading them costs nothing next to the transfer.
        digest = hashlib.blake2b(struct.pack("<q", self._seed), digest_size=8)
        for name in sorted(named):
            digest.update(name.encode())
            digest.update(named[name].detach().reshape(-1)[:16].float().numpy().tobytes())
        self._seed = int.from_bytes(digest.digest(), "little") >> 1


def _digest(seed: int | None, position: int, tokens: Sequence[int]) -> int:
    data = struct.pack(f"<qq{len(tokens)}q", -1 if seed is None else seed, position, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _log_softmax(logits: Sequence[float], temperature: float) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    norm = top + math.log(sum(math.exp(x - top) for x in scaled))
    return [x - norm for x in scaled]
