"""Weight swaps and engine moves while agents wait: every request completes as one completion made of
the partial output (old version) and its continuation (new version), and the sink holds both segments."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.request
from collections.abc import Callable

import openai
import pytest

from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine import tokenizer as tk
from tests.endpoint.conftest import LETTERS, MODEL, RecordingManager, make_engine, replay

TOK = tk.ByteTokenizer()
MAX_TOKENS = 60


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Agents:
    """Requests in threads; half stream (and report progress), half do not."""

    def __init__(self, client: openai.OpenAI, count: int) -> None:
        self.client = client
        self.seen = [0] * count
        self.pool = concurrent.futures.ThreadPoolExecutor(count)
        self.futures = [self.pool.submit(self._one, i) for i in range(count)]

    @staticmethod
    def messages(i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"task {i}"}]

    def _one(self, i: int) -> tuple[str, list[int], list[int], str]:
        kwargs = dict(model=MODEL, messages=self.messages(i), max_tokens=MAX_TOKENS, seed=i)
        if i % 2:
            done = self.client.chat.completions.create(**kwargs)
            return done.trajectory_id, done.choices[0].token_ids, done.choices[0].token_versions, \
                done.choices[0].finish_reason
        tokens, versions, tid, finish = [], [], "", ""
        for chunk in self.client.chat.completions.create(**kwargs, stream=True):
            tid = tid or chunk.trajectory_id
            tokens += chunk.choices[0].token_ids
            versions += chunk.choices[0].token_versions
            finish = chunk.choices[0].finish_reason or finish
            self.seen[i] = len(tokens)
        return tid, tokens, versions, finish

    def results(self) -> list[tuple[str, list[int], list[int], str]]:
        out = [f.result(timeout=60) for f in self.futures]
        self.pool.shutdown()
        return out


def check_split(results, sink: RecordingManager, old_seed: int, new_seed: int, old_version: int, new_version: int,
                old_engine: str, new_engine: str) -> None:
    """Each completion = prefix by the old weights + continuation by the new ones, recorded as two segments."""
    for i, (tid, tokens, versions, finish) in enumerate(results):
        assert finish == "length" and len(tokens) == MAX_TOKENS
        cut = versions.index(new_version)
        assert 0 < cut < MAX_TOKENS, f"request {i} was not paused mid-generation"
        assert versions == [old_version] * cut + [new_version] * (MAX_TOKENS - cut)
        prompt = TOK.apply_chat_template(Agents.messages(i))
        prefix, _ = replay(make_engine(seed=old_seed, vocab=LETTERS), prompt, cut, seed=i)
        rest, rest_lp = replay(make_engine(seed=new_seed, vocab=LETTERS), prompt + tokens[:cut], MAX_TOKENS - cut,
                               seed=i)
        assert tokens[:cut] == prefix and tokens[cut:] == rest
        first, second = sink.generated(tid)
        assert (first.tokens.tolist(), first.versions.tolist(), first.finish_reason, first.engine) == \
            (tokens[:cut], [old_version] * cut, "abort", old_engine)
        assert (second.tokens.tolist(), second.versions.tolist(), second.finish_reason, second.engine) == \
            (tokens[cut:], [new_version] * (MAX_TOKENS - cut), "length", new_engine)
        assert second.logprobs.tolist() == pytest.approx(rest_lp, rel=1e-5)
        assert sink.calls[tid] == ["start", "add_generated:abort", "interrupt", "add_generated:length"]
        assert sink.context(tid) == prompt + tokens


def test_weight_swap_during_requests_is_invisible_to_agents(sink: RecordingManager) -> None:
    engine = make_engine(seed=1, delay=0.01, vocab=LETTERS)
    endpoint = AgentEndpoint(engine, sink)
    with EndpointServer(OpenAIApi(endpoint, model_name=MODEL)) as server:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=60)
        agents = Agents(client, 8)
        wait_until(lambda: engine.in_flight == 8 and engine.fewest_generated >= 3)  # every request mid-reply
        server.call(engine.pause())
        wait_until(lambda: engine.in_flight == 0)  # every stream ended with 'abort' at its next token
        # While paused, requests wait (none completes) and a new one is accepted and waits too.
        late = threading.Thread(target=lambda: late_result.append(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "late"}], max_tokens=5, seed=1)))
        late_result: list = []
        late.start()
        time.sleep(0.3)
        assert not any(f.done() for f in agents.futures) and not late_result
        with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=5) as health:
            assert json.load(health)["paused"] is True
        assert server.call(engine.load_weights([("seed", 2)], version=3)) == 3
        server.call(engine.resume())
        results = agents.results()
        late.join(timeout=30)
    check_split(results, sink, 1, 2, 0, 3, "scripted", "scripted")
    assert late_result[0].choices[0].token_versions == [3] * 5


def test_generations_move_to_another_engine_and_finish_there(sink: RecordingManager) -> None:
    first = make_engine(seed=1, delay=0.01, vocab=LETTERS, name="engine-a", version=0)
    second = make_engine(seed=7, delay=0.001, vocab=LETTERS, name="engine-b", version=5)
    endpoint = AgentEndpoint(first, sink)
    with EndpointServer(OpenAIApi(endpoint, model_name=MODEL)) as server:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=60)
        agents = Agents(client, 4)
        wait_until(lambda: first.in_flight == 4 and first.fewest_generated >= 3)  # every request mid-reply
        old = server.call(endpoint.replace_engine(second))
        results = agents.results()
        assert old is first and first.paused and first.in_flight == 0 and endpoint.engine is second
    check_split(results, sink, 1, 7, 0, 5, "engine-a", "engine-b")


def test_weight_update_helper_on_an_engine_that_is_idle(server: EndpointServer, client: openai.OpenAI) -> None:
    before = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=8,
                                            seed=1, temperature=0)
    assert server.call(server.api.endpoint.update_weights([("seed", 42)])) == 1
    after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=8,
                                           seed=1, temperature=0)
    assert set(before.choices[0].token_versions) == {0} and set(after.choices[0].token_versions) == {1}
    assert before.choices[0].token_ids != after.choices[0].token_ids


def test_cancelled_turns_end_their_generation_and_keep_what_was_recorded(sink: RecordingManager) -> None:
    """What a rollout rank does for a group the run dropped while it played: the turn's generation ends on
    the engine (it does not run on to its budget), the agent's call fails, the partial segment is kept."""
    engine = make_engine(seed=3, delay=0.01, vocab=LETTERS)
    with EndpointServer(OpenAIApi(AgentEndpoint(engine, sink), model_name=MODEL)) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
        seen: dict[str, object] = {"tokens": 0}

        def agent() -> None:
            try:
                for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                            max_tokens=MAX_TOKENS, stream=True):
                    extra = chunk.model_extra or {}
                    seen.setdefault("tid", extra.get("trajectory_id"))
                    if chunk.choices:
                        seen["tokens"] = int(seen["tokens"]) + len(chunk.choices[0].token_ids)  # type: ignore
            except openai.APIError as exc:
                seen["error"] = exc

        thread = threading.Thread(target=agent)
        thread.start()
        wait_until(lambda: int(seen["tokens"]) >= 5)  # type: ignore[call-overload]

        async def cancel() -> int:
            return server.api.endpoint.cancel_turns([str(seen["tid"])])

        assert server.call(cancel(), timeout=10) == 1
        thread.join(timeout=30)
        wait_until(lambda: engine.in_flight == 0)
        segments = sink.generated(str(seen["tid"]))
        assert len(segments) == 1 and segments[0].finish_reason == "abort"
        assert 5 <= len(segments[0].tokens) < MAX_TOKENS  # cut mid-way, not run to its budget
        assert "error" in seen or int(seen["tokens"]) < MAX_TOKENS  # type: ignore[call-overload]
        assert server.call(cancel(), timeout=10) == 0  # nothing runs for it any more


def test_a_handed_off_trajectory_stops_here_even_when_its_caller_went_away(sink: RecordingManager) -> None:
    """What a rollout rank does for an episode it releases to another rank: the episode's agent (a
    non-streamed HTTP call, as a multi-turn task's) is cancelled and goes away, but the handler serving its
    call would generate on. `hand_off` cuts that turn and returns once its partial segment is recorded; a
    later call for the trajectory is refused here (503) until it is taken back."""
    engine = make_engine(seed=3, delay=0.01, vocab=LETTERS)
    with EndpointServer(OpenAIApi(AgentEndpoint(engine, sink), model_name=MODEL)) as server:
        first = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
        opened = first.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        tid = opened.model_extra["trajectory_id"]  # type: ignore[index]
        history = [{"role": "user", "content": "x"}, opened.choices[0].message.model_dump(exclude_none=True),
                   {"role": "user", "content": "more"}]
        # The agent's second call gives up after 0.3 s, as a cancelled episode's call does: its handler runs on.
        impatient = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=MODEL, messages=history, max_tokens=MAX_TOKENS,
                                              extra_headers={"X-Trajectory-Id": tid})
        assert engine.in_flight == 1  # still generating for nobody

        async def hand_off() -> int:
            return await server.api.endpoint.hand_off([tid])

        assert server.call(hand_off(), timeout=30) == 1
        cut = sink.generated(tid)[-1]
        assert cut.finish_reason == "abort" and 0 < len(cut.tokens) < MAX_TOKENS
        time.sleep(0.3)  # nothing more is appended: the donor stopped
        assert sink.generated(tid)[-1] == cut and engine.in_flight == 0
        with pytest.raises(openai.InternalServerError, match="moved to another rank"):
            first.chat.completions.create(model=MODEL, messages=history, max_tokens=2,
                                          extra_headers={"X-Trajectory-Id": tid})
        assert server.api.health()["turns_refused_after_move"] == 1

        async def take_back() -> None:
            server.api.endpoint.take_back(tid)

        server.call(take_back(), timeout=10)
        assert first.chat.completions.create(model=MODEL, messages=history, max_tokens=2,
                                             extra_headers={"X-Trajectory-Id": tid}).choices[0].message.content
