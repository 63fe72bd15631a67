"""Hugging Face model folders (a tiny Qwen2 and a tiny Llama, built here with their own BPE tokenizer and chat
template) served by a real vLLM engine behind the endpoint: the prompt tokens are exactly the chat template's,
the engine's logprobs are the trainer's, and the trainer's weights (Qwen2's q/k/v biases, Llama's untied
output layer) load into the engine under the names it publishes. One engine per architecture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer

from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine.base import GenerationRequest
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.engine.tokenizer import load_tokenizer
from sfhpc.engine.vllm_engine import VllmEngine
from sfhpc.model.hf_folder import build_hf_model
from sfhpc.trainer.batch import TrainBatch, TrainRow
from sfhpc.trainer.torch_trainer import TorchTrainer

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "system", "content": "Answer with one letter."}, {"role": "user", "content": "after b, ünï?"}]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Path, EndpointServer, VllmEngine, TrajectoryManager, HFTokenizer]]:
    arch = request.param
    folder = build_hf_model(tmp_path_factory.mktemp(arch) / "model", arch, kv_heads=1 if arch == "llama" else None)
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, HFTokenizer)
    manager = TrajectoryManager()
    endpoint = AgentEndpoint(ScriptedEngine(seed=0), manager)
    with EndpointServer(OpenAIApi(endpoint, model_name=arch, tokenizer=tokenizer)) as server:
        async def switch() -> VllmEngine:
            engine = VllmEngine.start(f"vllm-{arch}", folder, max_model_len=256)
            await endpoint.replace_engine(engine)
            return engine
        engine = server.call(switch(), timeout=300)
        yield arch, folder, server, engine, manager, tokenizer
        engine.shutdown()


def test_prompt_tokens_are_the_chat_templates_and_the_reply_decodes(served) -> None:  # type: ignore[no-untyped-def]
    arch, folder, server, engine, manager, tokenizer = served
    hf = AutoTokenizer.from_pretrained(folder)  # the reference: transformers' own tokenizer of the folder
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=arch, messages=MESSAGES,
                                           max_tokens=6, logprobs=True, extra_body={"seed": 1})
    extra = reply.model_extra or {}
    assert extra["prompt_token_ids"] == expected
    trajectory = manager.trajectory(extra["trajectory_id"])
    assert trajectory.segments[0].tokens.tolist() == expected  # what the manager recorded as the prompt
    generated = reply.choices[0].token_ids  # type: ignore[attr-defined]
    assert manager.context(extra["trajectory_id"]) == expected + generated
    assert reply.choices[0].message.content == hf.decode(generated, skip_special_tokens=True)
    assert [c.bytes for c in reply.choices[0].logprobs.content] == \
        [tokenizer.token_bytes(t) for t in generated]  # type: ignore[union-attr]
    # The reply ends at the template's end-of-turn token or the model's EOS: both are the default stops.
    ends = {"qwen2": "<|im_end|>", "llama": "<|eot_id|>"}[arch]
    assert tokenizer.chat_stop_ids[0] == hf.convert_tokens_to_ids(ends)
    assert hf.eos_token_id in tokenizer.chat_stop_ids


async def _greedy(engine: VllmEngine, prompt: list[int], rid: str) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for chunk in engine.generate(GenerationRequest(rid, tuple(prompt), 12, temperature=0.0)):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
    return tokens, logprobs


def test_trainer_and_engine_agree_and_published_weights_load(served) -> None:  # type: ignore[no-untyped-def]
    arch, folder, server, engine, _, tokenizer = served
    prompt = tokenizer.apply_chat_template(MESSAGES)
    before, engine_logprobs = server.call(_greedy(engine, prompt, "before"))
    trainer = TorchTrainer(folder)
    row = TrainRow(prompt + before, [False] * len(prompt) + [True] * len(before), [0.0] * len(prompt + before),
                   [-1] * len(prompt) + [0] * len(before), 0.0)
    with torch.no_grad():
        trained = trainer.logprobs(TrainBatch.from_rows([row]))[0, len(prompt):len(prompt) + len(before)]
    # Same folder, same numbers: the engine's (bf16) sampling logprobs are the trainer's (fp32) ones.
    assert (trained - torch.tensor(engine_logprobs)).abs().max() < 0.05

    names = dict(trainer.named_weights())
    if arch == "qwen2":  # q/k/v biases are published, and the tied output layer is the embedding alone
        assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names
        touched = [n for n in names if n.endswith(("q_proj.bias", "k_proj.bias"))]
    else:
        assert "lm_head.weight" in names and not any(n.endswith(".bias") for n in names)
        touched = ["lm_head.weight"]
    with torch.no_grad():
        for name in touched:  # a change only these weights carry: it reaches the engine only if they load
            names[name].add_(torch.randn_like(names[name]) * 4.0)

    async def reload(version: int) -> tuple[list[int], list[float]]:
        await engine.pause()
        await engine.load_weights(trainer.named_weights(torch.bfloat16), version=version)
        await engine.resume()
        return await _greedy(engine, prompt, f"v{version}")

    changed, changed_logprobs = server.call(reload(engine.version + 1))
    assert (changed, changed_logprobs) != (before, engine_logprobs)
    with torch.no_grad():
        for name in touched:
            names[name].copy_(TorchTrainer(folder).model.state_dict()[name])
    assert server.call(reload(engine.version + 1))[0] == before  # the original weights, the original reply
