"""NaN, Infinity and -Infinity in any numeric field of a request: a 400 naming the field, nothing recorded.

Python's JSON (the server's decoder, and `json.dumps` in a Python agent) reads and writes these three
constants, and every range check with NaN is false, so each field is tried over real HTTP with the bytes
a Python client sends.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sfhpc.endpoint import EndpointServer
from sfhpc.endpoint.client import LocalClient
from sfhpc.endpoint.errors import BadRequest
from tests.endpoint.conftest import MODEL, RecordingManager

NON_FINITE = (math.nan, math.inf, -math.inf)
MESSAGES = [{"role": "user", "content": "hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


# (route, field, the body with that field holding `x`): every number a request body may carry.
CASES: list[tuple[str, str, Callable[[float], dict[str, Any]]]] = [
    *[("chat/completions", key, lambda x, key=key: chat(**{key: x})) for key in (
        "temperature", "top_p", "seed", "max_tokens", "max_completion_tokens", "top_logprobs", "n", "best_of",
        "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")],
    ("chat/completions", "stop_token_ids", lambda x: chat(stop_token_ids=[2, x])),
    *[("completions", key, lambda x, key=key: completion(**{key: x})) for key in (
        "temperature", "top_p", "seed", "max_tokens", "logprobs", "n", "best_of")],
    ("completions", "prompt", lambda x: completion(prompt=[1, 2, x])),
    ("completions", "prompt", lambda x: completion(prompt=[[1, x]])),  # a batch of one prompt
]


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    raw = json.dumps(body)  # allow_nan: the bytes NaN / Infinity / -Infinity, as a Python agent sends them
    return httpx.post(url, content=raw.encode(), headers={"Content-Type": "application/json"}, timeout=30)


def test_every_numeric_field_refuses_nan_and_infinities(server: EndpointServer, sink: RecordingManager) -> None:
    wrong = []
    for route, field, body in CASES:
        for value in NON_FINITE:
            answer = post(f"{server.url}/{route}", body(value))
            error = answer.json().get("error") or {}
            if (answer.status_code, error.get("param")) != (400, field) or "finite" not in error.get("message", ""):
                wrong.append((route, field, value, answer.status_code, error))
    assert wrong == []
    assert sink.ids() == []  # nothing refused reached the trajectory manager
    # The same fields with finite values are served (the refusals above were about the values).
    ok = post(f"{server.url}/chat/completions", chat(temperature=0.5, top_p=0.9, seed=7))
    assert ok.status_code == 200 and len(sink.ids()) == 1


def test_the_refusal_names_the_field_and_the_value(server: EndpointServer, sink: RecordingManager) -> None:
    answer = post(f"{server.url}/chat/completions", chat(temperature=math.nan))
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "temperature"
    assert "'temperature' is nan" in answer.json()["error"]["message"]
    assert sink.ids() == []


def test_an_episode_refuses_a_non_finite_reward(server: EndpointServer, sink: RecordingManager) -> None:
    episode = server.api.episodes.open(task="t", group="g", takes_posted_reward=True)
    base = server.episode_url(episode.id)
    # A turn with a NaN temperature on the episode's URL starts no trajectory.
    answer = post(f"{base}/chat/completions", chat(temperature=math.nan))
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "temperature")
    assert episode.seat().trajectory_id is None and sink.ids() == []
    for value in NON_FINITE:
        answer = post(f"{base.removesuffix('/v1')}/reward", {"reward": value})
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, "reward"), value
        assert "finite" in answer.json()["error"]["message"]
    assert episode.seat().reward is None
    assert post(f"{base.removesuffix('/v1')}/reward", {"reward": 0.25}).json()["reward"] == 0.25
    assert episode.seat().reward == 0.25


def test_the_in_process_client_refuses_them_too(server: EndpointServer, sink: RecordingManager) -> None:
    client = LocalClient(server.api, server.loop)
    with pytest.raises(BadRequest) as err:
        client.chat(**chat(top_p=math.nan))
    assert err.value.status == 400 and err.value.param == "top_p"
    assert sink.ids() == []
