"""The tokenizer and the scripted engine: the contract the endpoint relies on, checked on values."""

from __future__ import annotations

import asyncio
import math

import pytest

from sfhpc.engine import tokenizer as tk
from sfhpc.engine.base import EngineStateError, GenerationRequest
from tests.endpoint.conftest import LETTERS, make_engine, replay


def test_tokenizer_round_trips_text_and_builds_the_documented_chat_format() -> None:
    tok = tk.ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text, bos=True)
    assert ids[0] == tk.BOS and ids[1:] == list(text.encode())
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat == [tk.BOS, tk.SYSTEM, *b"be brief", tk.END, tk.USER, *b"hi", tk.END, tk.ASSISTANT]
    # A character split across stream chunks comes out once, whole.
    decoder = tok.stream_decoder()
    check = "✓".encode()
    assert decoder.feed(check[:1]) == "" and decoder.feed(check[1:]) == "✓"
    with pytest.raises(tk.ChatFormatError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_scripted_engine_is_deterministic_with_real_logprobs() -> None:
    engine = make_engine(seed=5)
    prompt = [tk.BOS, *b"abc"]
    tokens, logprobs = replay(engine, prompt, 20, seed=11)
    assert (tokens, logprobs) == replay(make_engine(seed=5), prompt, 20, seed=11)
    assert len(tokens) <= 20 and all(t in engine.vocab for t in tokens)
    context = list(prompt)
    for token, logprob in zip(tokens, logprobs):
        dist = engine.next_token_logprobs(context)
        assert math.isclose(sum(math.exp(v) for v in dist.values()), 1.0)
        assert logprob == pytest.approx(dist[token])
        context.append(token)
    greedy, _ = replay(engine, prompt, 10, temperature=0)
    context = list(prompt)
    for token in greedy:
        dist = engine.next_token_logprobs(context)
        assert token == max(dist, key=dist.__getitem__)
        context.append(token)


def test_pause_aborts_mid_generation_and_continuation_matches_with_new_weights() -> None:
    async def scenario() -> None:
        engine = make_engine(seed=1, delay=0.005, vocab=LETTERS)
        request = GenerationRequest("r1", (tk.BOS, *b"go"), 50, seed=3)
        chunks = []

        async def consume() -> None:
            async for chunk in engine.generate(request):
                chunks.append(chunk)

        task = asyncio.create_task(consume())
        while sum(len(c.token_ids) for c in chunks) < 5:
            await asyncio.sleep(0.005)
        with pytest.raises(EngineStateError, match="pause"):
            await engine.load_weights([("seed", 2)])
        await engine.pause()
        await task
        assert chunks[-1].finish_reason == "abort" and engine.in_flight == 0
        partial = [t for c in chunks for t in c.token_ids]
        assert 5 <= len(partial) < 50 and {v for c in chunks for v in c.versions} == {0}
        assert partial == replay(make_engine(seed=1, vocab=LETTERS), request.prompt_token_ids, len(partial), seed=3)[0]
        assert await engine.load_weights([("seed", 2)]) == 1 and engine.version == 1
        await engine.resume()
        rest = [c async for c in engine.generate(request.continued(partial, "r1b"))]
        tail = [t for c in rest for t in c.token_ids]
        assert rest[-1].finish_reason == "length" and len(partial) + len(tail) == 50
        assert {v for c in rest for v in c.versions} == {1}
        fresh = make_engine(seed=2, vocab=LETTERS)
        assert tail == replay(fresh, (*request.prompt_token_ids, *partial), 50 - len(partial), seed=3)[0]
        # The new weights really changed the model.
        old = replay(make_engine(seed=1, vocab=LETTERS), (*request.prompt_token_ids, *partial), 50, seed=3)[0]
        assert tail != old[:len(tail)]

    asyncio.run(scenario())


def test_abort_ends_one_request_and_leaves_others_running() -> None:
    async def scenario() -> None:
        engine = make_engine(delay=0.002, vocab=LETTERS)

        async def run(rid: str) -> list:
            return [c async for c in engine.generate(GenerationRequest(rid, (tk.BOS,), 30, seed=1))]

        first, second = asyncio.create_task(run("a")), asyncio.create_task(run("b"))
        await asyncio.sleep(0.02)
        await engine.abort("a")
        a, b = await first, await second
        assert a[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in a) < 30
        assert b[-1].finish_reason == "length" and sum(len(c.token_ids) for c in b) == 30

    asyncio.run(scenario())
