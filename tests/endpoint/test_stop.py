"""OpenAI's ``stop`` strings: the text ends before the first stop string met, whole or streamed; the
generation ends there on the engine, and the trajectory keeps the tokens sampled up to it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine import tokenizer as tk
from tests.endpoint.conftest import RecordingManager, ReplyingEngine

REPLY = "the answer is 42. and then more words"


@pytest.fixture
def served() -> Iterator[tuple[EndpointServer, RecordingManager, ReplyingEngine]]:
    engine = ReplyingEngine([])
    sink = RecordingManager()
    with EndpointServer(OpenAIApi(AgentEndpoint(engine, sink), model_name="m")) as server:
        yield server, sink, engine


def test_a_stop_string_ends_the_text_and_the_generation(served: tuple[EndpointServer, RecordingManager,
                                                                      ReplyingEngine]) -> None:
    server, sink, engine = served
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    engine.replies += [list(REPLY.encode()) + [tk.END]] * 3
    ask = {"model": "m", "messages": [{"role": "user", "content": "?"}]}
    reply = client.chat.completions.create(**ask, stop=[". ", "zzz"])
    assert reply.choices[0].message.content == "the answer is 42" and reply.choices[0].finish_reason == "stop"
    # The engine stopped at the token that completed the stop string; those tokens are what is recorded.
    [segment] = sink.generated(reply.model_extra["trajectory_id"])
    assert bytes(segment.tokens.tolist()) == b"the answer is 42. " and segment.finish_reason == "stop"

    chunks = client.chat.completions.create(**ask, stop="42.", stream=True)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "the answer is " and not any("4" in p for p in pieces)

    text = client.completions.create(model="m", prompt="q", stop=["more"], max_tokens=64)
    assert text.choices[0].text == "the answer is 42. and then "

    for bad in (["a", "b", "c", "d", "e"], 3, [1]):
        response = httpx.post(f"{server.url}/chat/completions", json={**ask, "stop": bad})
        assert (response.status_code, response.json()["error"]["param"]) == (400, "stop")
