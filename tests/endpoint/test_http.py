"""Plain HTTP: curl for a chat completion, a streamed one and an error; every kind of bad input answered
with a 4xx in OpenAI's error shape while the server keeps serving; the bearer-token guard (on every
route, loopback too) and the run's own token."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from sfhpc.endpoint import AgentEndpoint, EndpointConfigError, EndpointServer, OpenAIApi, new_run_token
from sfhpc.engine import tokenizer as tk
from tests.endpoint.conftest import MODEL, RecordingManager, make_engine, replay

TOK = tk.ByteTokenizer()
pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")


def curl(url: str, *args: str) -> tuple[int, str]:
    """Run curl; returns (HTTP status, body)."""
    done = subprocess.run(["curl", "-sS", "-N", "-w", "\n%{http_code}", *args, url], capture_output=True,
                          text=True, timeout=30, check=True)
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "seed": 3, **extra}


def test_curl_chat_streamed_chat_and_error(server: EndpointServer, sink: RecordingManager) -> None:
    url = f"{server.url}/chat/completions"
    status, text = curl(url, "-H", "Content-Type: application/json", "-d", json.dumps(chat_body()))
    body = json.loads(text)
    assert status == 200 and body["object"] == "chat.completion"
    expected = replay(make_engine(seed=1), TOK.apply_chat_template(chat_body()["messages"]), 6, seed=3,
                      stop=TOK.chat_stop_ids)[0]
    assert body["choices"][0]["token_ids"] == expected
    assert body["choices"][0]["message"]["content"] == TOK.decode(expected)

    status, text = curl(url, "-H", "Content-Type: application/json", "-H",
                        f"X-Trajectory-Id: {body['trajectory_id']}", "-d", json.dumps(chat_body(stream=True)))
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected  # same prompt, same seed
    assert chunks[0]["trajectory_id"] == body["trajectory_id"]
    assert sink.calls[body["trajectory_id"]][:3] == ["start", "add_generated:" + body["choices"][0]["finish_reason"],
                                                      "observe"]

    status, text = curl(url, "-H", "Content-Type: application/json", "-d", "{not json")
    assert status == 400 and set(json.loads(text)["error"]) == {"message", "type", "param", "code"}


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server: EndpointServer,
                                                                   sink: RecordingManager) -> None:
    url = f"{server.url}/chat/completions"
    finished = sink.start([tk.BOS, 1, 2])
    sink.finish(finished, reward=1.0)
    too_long = chat_body(messages=[{"role": "user", "content": "x" * 300}])
    cases = [
        (b"{not json", {}, 400, "invalid_request", None),
        (b"[1, 2]", {}, 400, "invalid_request", None),
        (json.dumps(chat_body(tools=[{"type": "function", "function": {"name": "f"}}])).encode(), {}, 400,
         "tools_not_supported", "tools"),  # the byte-level chat format renders no tools
        (json.dumps(chat_body()).encode(), {"X-Trajectory-Id": "nobody"}, 404, "trajectory_not_found",
         "trajectory_id"),
        (json.dumps(chat_body(user="nobody")).encode(), {}, 404, "trajectory_not_found", "trajectory_id"),
        (json.dumps(chat_body()).encode(), {"X-Trajectory-Id": finished}, 409, "trajectory_finished",
         "trajectory_id"),
        (json.dumps(too_long).encode(), {}, 400, "context_length_exceeded", "messages"),
        (json.dumps(chat_body(n=9)).encode(), {}, 400, "invalid_request", "n"),  # above max_n
        (json.dumps(chat_body(temperature=9)).encode(), {}, 400, "invalid_request", "temperature"),
        (json.dumps(chat_body(messages=[{"role": "robot", "content": "x"}])).encode(), {}, 400, "invalid_request",
         "messages"),
        (json.dumps(chat_body(user="a")).encode(), {"X-Trajectory-Id": "b"}, 400, "invalid_request", "user"),
    ]
    for raw, headers, status, code, param in cases:
        got_status, body = post(url, raw, headers)
        assert (got_status, body["error"]["code"], body["error"]["param"]) == (status, code, param), raw
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    status, body = post(f"{server.url}/nowhere", b"{}")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = post(f"{server.url}/models", b"{}")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body = post(f"{server.url}/completions", json.dumps({"model": MODEL, "prompt": [9999]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    # Nothing was recorded for a refused request; a good one still works.
    assert sink.ids() == [finished]
    status, body = post(url, json.dumps(chat_body()).encode())
    assert status == 200 and len(body["choices"][0]["token_ids"]) > 0


def test_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_headers={"X-Trajectory-Id": "missing"})
    assert err.value.status_code == 404 and err.value.body["code"] == "trajectory_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 400}])
    assert err.value.body["code"] == "context_length_exceeded"


def test_token_guard(sink: RecordingManager) -> None:
    api = OpenAIApi(AgentEndpoint(make_engine(), sink), model_name=MODEL)
    with pytest.raises(EndpointConfigError, match="token"):
        EndpointServer(api, host="0.0.0.0")
    with EndpointServer(api, host="0.0.0.0", token="s3cret") as server:
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        raw = json.dumps(chat_body()).encode()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, body = post(url, raw, headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, text = curl(f"http://127.0.0.1:{server.port}/v1/models")
        assert status == 401
        status, text = curl(f"http://127.0.0.1:{server.port}/health")
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        status, text = curl(f"http://127.0.0.1:{server.port}/health", "-H", "Authorization: Bearer s3cret")
        assert status == 200 and json.loads(text)["status"] == "ok"
        status, body = post(url, raw, {"Authorization": "Bearer s3cret"})
        assert status == 200
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(**chat_body()).choices[0].token_ids == body["choices"][0]["token_ids"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="nope",
                          max_retries=0).models.list()
    assert len(sink.ids()) == 2  # the two accepted requests only


def test_run_token_is_required_on_loopback_on_every_route(sink: RecordingManager) -> None:
    token = new_run_token()
    assert len(token) >= 40 and token != new_run_token()  # fresh random secret each time
    api = OpenAIApi(AgentEndpoint(make_engine(), sink), model_name=MODEL, token=token)
    with EndpointServer(api) as server:  # 127.0.0.1, the token taken from the API
        assert server.host == "127.0.0.1" and server.token == token
        base = f"http://127.0.0.1:{server.port}"
        raw = json.dumps(chat_body()).encode()
        for route, body in (("/v1/chat/completions", raw), ("/v1/completions", b"{}"), ("/v1/nowhere", b"{}")):
            for headers in ({}, {"Authorization": f"Bearer {token[:-1]}"}, {"Authorization": token}):
                status, answer = post(base + route, body, headers)
                assert status == 401, (route, headers)
                assert set(answer["error"]) == {"message", "type", "param", "code"}
                assert answer["error"]["code"] == "invalid_api_key" and "Bearer" in answer["error"]["message"]
        for route in ("/v1/models", "/health"):
            assert curl(base + route)[0] == 401
            assert curl(base + route, "-H", f"Authorization: Bearer {token}")[0] == 200
        assert sink.ids() == []  # nothing refused reached the trajectory manager
        # The run's own agents: the openai client with the token as api_key works, a wrong key is refused.
        client = openai.OpenAI(base_url=server.url, api_key=token, max_retries=0)
        reply = client.chat.completions.create(**chat_body())
        assert reply.choices[0].token_ids and len(sink.ids()) == 1
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0).chat.completions.create(**chat_body())
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert len(sink.ids()) == 1


def test_the_runs_http_agents_send_the_token(sink: RecordingManager) -> None:
    import asyncio

    from sfhpc.rollout.agent import OpenAIChat

    token = new_run_token()
    api = OpenAIApi(AgentEndpoint(make_engine(), sink), model_name=MODEL, token=token)
    with EndpointServer(api) as server:
        async def turn(key: str) -> str:
            backend = OpenAIChat(server.url, MODEL, api_key=key)
            try:
                reply = await backend.chat([{"role": "user", "content": "hi"}], trajectory_id=None, task="t",
                                           group="g", max_tokens=4, seed=1)
                return reply.trajectory_id
            finally:
                await backend.client.close()

        assert asyncio.run(turn(token)) in sink.ids()
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(turn("unused"))
