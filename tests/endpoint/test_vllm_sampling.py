"""With real vLLM: a chat turn sampled at temperature 0.7 is recorded with 0.7, and the trainer's recomputed
logprobs of its tokens (at the recorded temperature) are the engine's. vLLM runs with processed logprobs
(those of the tempered distribution it sampled from); the trainer tempers its logits the same way."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.endpoint.service import SamplingRule
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.engine.tokenizer import load_tokenizer
from sfhpc.engine.vllm_engine import VllmEngine
from sfhpc.model.hf_folder import build_hf_model
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.torch_trainer import TorchTrainer

pytestmark = pytest.mark.vllm
MODEL = "tiny-qwen2"
# float32 on both sides: what is left is the two implementations' arithmetic, not bf16 rounding (measured
# here: a max gap of 1e-6 over 24 tokens).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, EndpointServer, TrajectoryManager]]:
    folder = build_hf_model(tmp_path_factory.mktemp("qwen2") / "model", "qwen2")
    manager = TrajectoryManager()
    endpoint = AgentEndpoint(ScriptedEngine(seed=0), manager)
    api = OpenAIApi(endpoint, model_name=MODEL, tokenizer=load_tokenizer(folder), sampling_rule=SamplingRule(1.0))
    with EndpointServer(api) as server:
        async def switch() -> VllmEngine:
            engine = VllmEngine.start("vllm-sampling", folder, max_model_len=256, dtype="float32")
            await endpoint.replace_engine(engine)
            return engine
        engine = server.call(switch(), timeout=300)
        yield folder, server, manager
        engine.shutdown()


def test_vllm_logprobs_at_temperature_07_are_the_trainers(served: tuple[Path, EndpointServer, TrajectoryManager]
                                                          ) -> None:
    folder, server, manager = served
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say something"}],
                                           max_tokens=24, temperature=0.7, logprobs=True, extra_body={"seed": 3})
    tid = (reply.model_extra or {})["trajectory_id"]
    segments = [s for s in manager.trajectory(tid).segments if s.generated]
    assert [(s.temperature, s.top_p) for s in segments] == [(0.7, 1.0)]
    manager.finish(tid, reward=1.0)
    batch = TrainBatch.from_trajectories([manager.trajectory(tid)])
    mask = batch.generated[0]
    assert int(mask.sum()) == len(reply.choices[0].token_ids) > 0  # type: ignore[attr-defined]

    trainer = TorchTrainer(folder)
    with torch.no_grad():
        scored = trainer.logprobs(batch)[0, mask]
        at_one = trainer.logprobs(dataclasses.replace(batch, temperatures=None))[0, mask]
    engine_logprobs = batch.behaviour_logprobs[0, mask]
    gap = float((scored - engine_logprobs).abs().max())
    print(f"max |trainer - vLLM| at temperature 0.7 over {int(mask.sum())} tokens: {gap:.2e}")
    assert gap < TOLERANCE
    # The comparison can tell: scored at temperature 1 (or vLLM's raw logprobs), the same tokens are far off.
    assert float((at_one - engine_logprobs).abs().max()) > 100 * TOLERANCE

