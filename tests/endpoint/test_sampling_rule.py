"""An RL run's endpoint refuses sampling its trainer cannot match, before anything is recorded."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.endpoint.service import SamplingRule
from sfhpc.engine.scripted import ScriptedEngine
from tests.endpoint.conftest import MODEL, RecordingManager

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def ruled(engine: ScriptedEngine, sink: RecordingManager) -> Iterator[openai.OpenAI]:
    api = OpenAIApi(AgentEndpoint(engine, sink), model_name=MODEL, sampling_rule=SamplingRule(1.0, 1.0))
    with EndpointServer(api) as server:
        yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def test_other_temperatures_and_nuclei_are_refused_with_a_clear_400(ruled: openai.OpenAI,
                                                                   sink: RecordingManager) -> None:
    for field, value in (("temperature", 0.7), ("temperature", 0), ("top_p", 0.9)):
        with pytest.raises(openai.BadRequestError) as refused:
            ruled.chat.completions.create(**CHAT, **{field: value})
        error = refused.value.body
        assert (error["param"], error["code"]) == (field, "unsupported_sampling")
        assert f"{field} {value:g} cannot be trained on" in error["message"]
    with pytest.raises(openai.BadRequestError):
        ruled.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=1.5)
    assert sink.ids() == []  # nothing recorded for a refused call
    ruled.chat.completions.create(**CHAT)  # OpenAI's defaults (1, 1) are the trainer's
    ruled.chat.completions.create(**CHAT, temperature=1.0, top_p=1)
    assert len(sink.ids()) == 2
