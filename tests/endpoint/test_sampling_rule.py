"""Sampling per turn: the endpoint records the temperature and top-p each turn was sampled with (the
agent's, or the run's default) on its segment, in the store too; an RL run's endpoint refuses, before
anything is recorded, the sampling its trainer cannot reproduce."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore, open_store
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.endpoint.service import SamplingRule
from sfhpc.engine.scripted import ScriptedEngine
from tests.endpoint.conftest import MODEL, RecordingManager

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
RUN_TEMPERATURE = 0.8  # the run's algorithm.temperature: what a turn that asks for none gets


def serve(engine: ScriptedEngine, sink: Any, rule: SamplingRule | None) -> EndpointServer:
    return EndpointServer(OpenAIApi(AgentEndpoint(engine, sink), model_name=MODEL, sampling_rule=rule))


@pytest.fixture
def ruled(engine: ScriptedEngine, sink: RecordingManager) -> Iterator[openai.OpenAI]:
    with serve(engine, sink, SamplingRule(RUN_TEMPERATURE)) as server:
        yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def test_what_the_trainer_cannot_reproduce_is_refused_with_a_clear_400(ruled: openai.OpenAI,
                                                                      sink: RecordingManager) -> None:
    refusals = [({"temperature": 0}, "temperature", "temperature 0 (greedy decoding) cannot be trained on"),
                ({"top_p": 0.9}, "top_p", "top_p 0.9 cannot be trained on"),
                ({"extra_body": {"top_k": 40}}, "top_k", "'top_k' = 40 is not supported"),
                ({"extra_body": {"min_p": 0.1}}, "min_p", "'min_p' = 0.1 is not supported"),
                ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty", "is not supported")]
    for fields, param, message in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            ruled.chat.completions.create(**CHAT, **fields)
        error = refused.value.body
        assert (error["param"], error["code"]) == (param, "unsupported_sampling")
        assert message in error["message"], error["message"]
    with pytest.raises(openai.BadRequestError):
        ruled.completions.create(model=MODEL, prompt="hi", max_tokens=3, top_p=0.5)
    assert sink.ids() == []  # nothing recorded for a refused call
    # Values that change nothing are served: top_p 1, top_k -1 (vLLM's "off").
    ruled.chat.completions.create(**CHAT, top_p=1, extra_body={"top_k": -1})
    assert len(sink.ids()) == 1


def test_each_turn_records_its_temperature_and_samples_at_it(ruled: openai.OpenAI, engine: ScriptedEngine,
                                                            sink: RecordingManager) -> None:
    messages = [{"role": "user", "content": "hi"}]
    first = ruled.chat.completions.create(**{**CHAT, "messages": messages}, temperature=0.7, logprobs=True)
    tid = (first.model_extra or {})["trajectory_id"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again"}]
    second = ruled.chat.completions.create(**{**CHAT, "messages": messages}, logprobs=True,
                                           extra_headers={"X-Trajectory-Id": tid})
    generated = sink.generated(tid)
    assert [(s.temperature, s.top_p) for s in generated] == [(0.7, 1.0), (RUN_TEMPERATURE, 1.0)]
    # The engine sampled each turn at that temperature: the logprobs it reported are of that distribution.
    for reply, segment, temperature in zip((first, second), generated, (0.7, RUN_TEMPERATURE)):
        prompt = (reply.model_extra or {})["prompt_token_ids"]
        tokens = segment.tokens.tolist()
        expected = [engine.next_token_logprobs(prompt + tokens[:i], temperature)[t] for i, t in enumerate(tokens)]
        assert segment.logprobs.tolist() == pytest.approx(expected, abs=1e-6)
        assert [c.logprob for c in reply.choices[0].logprobs.content] == pytest.approx(expected, abs=1e-6)  # type: ignore[union-attr]
        assert expected != pytest.approx([engine.next_token_logprobs(prompt + tokens[:i], 1.0)[t]
                                          for i, t in enumerate(tokens)], abs=1e-3)


def test_the_sampling_of_a_turn_is_read_back_from_the_store(engine: ScriptedEngine, tmp_path: Path) -> None:
    manager = TrajectoryManager(TrajectoryStore.create(tmp_path / "run.h5"))
    with serve(engine, manager, SamplingRule(RUN_TEMPERATURE)) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
        reply = client.chat.completions.create(**CHAT, temperature=0.7)
    tid = (reply.model_extra or {})["trajectory_id"]
    manager.finish(tid, reward=1.0)
    manager.close()
    with open_store(tmp_path / "run.h5") as store:
        stored = [s for s in store.get(tid).segments if s.generated]
    assert [s.tokens.tolist() for s in stored] == [reply.choices[0].token_ids]  # type: ignore[attr-defined]
    assert [s.temperature for s in stored] == [pytest.approx(0.7)] and stored[0].top_p == 1.0


def test_without_a_rule_any_sampling_is_served_and_recorded(engine: ScriptedEngine, sink: RecordingManager) -> None:
    with serve(engine, sink, None) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
        nucleus = client.chat.completions.create(**CHAT, temperature=1.5, top_p=0.5)
        default = client.chat.completions.create(**CHAT)
    recorded = [(s.temperature, s.top_p) for r in (nucleus, default)
                for s in sink.generated((r.model_extra or {})["trajectory_id"])]
    assert recorded == [(1.5, 0.5), (1.0, 1.0)]  # OpenAI's defaults where nothing was asked for
