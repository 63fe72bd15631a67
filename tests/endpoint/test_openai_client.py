"""The live endpoint through the official `openai` client: multi-turn trajectories, streaming,
concurrency, logprobs and token ids, and the in-process client's identical answers."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from sfhpc.endpoint import EndpointServer, LocalClient
from sfhpc.endpoint.errors import TrajectoryNotFound
from sfhpc.engine import tokenizer as tk
from sfhpc.engine.scripted import ScriptedEngine
from tests.endpoint.conftest import MODEL, RecordingManager, make_engine, replay

TOK = tk.ByteTokenizer()


def test_multi_turn_chat_grows_one_trajectory(client: openai.OpenAI, sink: RecordingManager) -> None:
    messages = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "name a colour"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=1)
    tid = first.trajectory_id
    assert first.prompt_token_ids == TOK.apply_chat_template(messages)
    tokens1 = first.choices[0].token_ids
    assert first.choices[0].message.content == TOK.decode(tokens1)
    assert sink.context(tid) == first.prompt_token_ids + tokens1

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "another"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=2,
                                            extra_headers={"X-Trajectory-Id": tid})
    assert second.trajectory_id == tid
    # The second prompt extends the first turn's tokens: the tree grows along one branch.
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(tokens1)] == first.prompt_token_ids + tokens1
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": "and a third"}]
    third = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=3, user=tid)
    assert third.trajectory_id == tid
    assert sink.context(tid) == third.prompt_token_ids + third.choices[0].token_ids
    record = sink.trajectory(tid)
    assert [s.kind for s in record.segments] == ["prompt", "generated", "observation", "generated",
                                                 "observation", "generated"]
    assert len(record.branch()) == len(record.segments)  # one branch: nothing forked
    assert record.num_generated == len(tokens1) + len(second.choices[0].token_ids) + len(third.choices[0].token_ids)
    assert [s.tokens.tolist() for s in sink.generated(tid)] == [tokens1, second.choices[0].token_ids,
                                                       third.choices[0].token_ids]
    assert len(sink.ids()) == 1


def test_logprobs_and_token_ids_are_the_engines(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    messages = [{"role": "user", "content": "count"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, seed=7, temperature=0.7,
                                          logprobs=True)
    choice = chat.choices[0]
    prompt = TOK.apply_chat_template(messages)
    expected, expected_lp = replay(make_engine(seed=1), prompt, 15, temperature=0.7, seed=7,
                                  stop=TOK.chat_stop_ids)
    assert choice.token_ids == expected and choice.token_versions == [0] * len(expected)
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(expected_lp)
    assert [c.token for c in choice.logprobs.content] == [TOK.token_text(t) for t in expected]
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == len(expected)
    context = list(prompt)
    for token, entry in zip(expected, choice.logprobs.content):
        assert entry.logprob == pytest.approx(engine.next_token_logprobs(context, 0.7)[token])
        context.append(token)

    text = client.completions.create(model=MODEL, prompt="once upon", max_tokens=9, seed=4, logprobs=0)
    expected, expected_lp = replay(make_engine(seed=1), TOK.encode("once upon", bos=True), 9, seed=4,
                                   stop=(tk.EOS,))
    tc = text.choices[0]
    assert tc.token_ids == expected and tc.text == TOK.decode(expected)
    assert tc.logprobs.token_logprobs == pytest.approx(expected_lp)
    assert tc.logprobs.text_offset == list(range(len(expected)))
    ids = client.completions.create(model=MODEL, prompt=[tk.BOS, 104, 105], max_tokens=4, temperature=0)
    assert ids.prompt_token_ids == [tk.BOS, 104, 105] and len(ids.choices[0].token_ids) == 4
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streaming_sends_the_same_tokens_as_a_plain_response(client: openai.OpenAI, sink: RecordingManager) -> None:
    messages = [{"role": "user", "content": "stream please"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, seed=9, logprobs=True)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, seed=9, logprobs=True,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    tid = chunks[0].trajectory_id
    assert tid != plain.trajectory_id and chunks[0].choices[0].delta.role == "assistant"
    tokens = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    logprobs = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == plain.choices[0].token_ids and text == plain.choices[0].message.content
    assert logprobs == pytest.approx([e.logprob for e in plain.choices[0].logprobs.content])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(tokens)
    assert sink.generated(tid)[0].tokens.tolist() == tokens

    completion = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=6, seed=2, stream=True))
    streamed = [t for c in completion for t in c.choices[0].token_ids]
    assert streamed == replay(make_engine(seed=1), TOK.encode("abc", bos=True), 6, seed=2, stop=(tk.EOS,))[0]


def test_eight_concurrent_trajectories_stay_apart(client: openai.OpenAI, sink: RecordingManager, engine) -> None:
    engine.token_delay = 0.002  # interleave the sessions token by token

    def session(i: int) -> tuple[str, list[int], list[int]]:
        messages = [{"role": "user", "content": f"agent {i} says hello"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=i, stream=i % 2 == 0)
        if i % 2 == 0:
            chunks = list(first)
            tid, content = chunks[0].trajectory_id, "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            tid, content = first.trajectory_id, first.choices[0].message.content
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
        second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=100 + i,
                                                extra_headers={"X-Trajectory-Id": tid})
        return tid, second.prompt_token_ids, second.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(session, range(8)))
    assert len({tid for tid, _, _ in results}) == 8 and len(sink.ids()) == 8
    for i, (tid, prompt, tokens) in enumerate(results):
        assert sink.context(tid) == prompt + tokens
        assert tokens == replay(make_engine(seed=1), prompt, 10, seed=100 + i, stop=TOK.chat_stop_ids)[0]
        assert f"agent {i} says".encode() in bytes(t for t in prompt if t < 256)


def test_in_process_client_answers_like_http(server: EndpointServer, client: openai.OpenAI,
                                             sink: RecordingManager) -> None:
    local = LocalClient(server.api, server.loop)
    messages = [{"role": "user", "content": "same"}]
    over_http = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                               seed=5).model_dump(exclude_unset=True)
    in_process = local.chat(model=MODEL, messages=messages, max_tokens=8, seed=5)
    for key in ("prompt_token_ids", "usage"):
        assert in_process[key] == over_http[key]
    assert in_process["choices"][0]["token_ids"] == over_http["choices"][0]["token_ids"]
    assert in_process["choices"][0]["message"]["content"] == over_http["choices"][0]["message"]["content"]
    tid = in_process["trajectory_id"]
    follow = messages + [in_process["choices"][0]["message"], {"role": "user", "content": "more"}]
    chunks = list(local.chat_stream(model=MODEL, messages=follow, max_tokens=8, seed=6, trajectory_id=tid))
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert sink.context(tid) == chunks[0]["prompt_token_ids"] + streamed
    with pytest.raises(TrajectoryNotFound) as err:
        local.chat(model=MODEL, messages=messages, trajectory_id="no-such-trajectory")
    assert err.value.status == 404 and err.value.body()["error"]["code"] == "trajectory_not_found"


def test_agent_that_leaves_mid_stream_leaves_an_interrupted_record(client: openai.OpenAI, sink: RecordingManager,
                                                                  engine) -> None:
    engine.token_delay = 0.01
    engine.vocab = tuple(v for v in engine.vocab if v != tk.END)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}],
                                            max_tokens=200, seed=1, stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 4:
            break
    stream.close()
    tid = chunks[0].trajectory_id
    deadline = time.monotonic() + 10
    while sink.status(tid) != "interrupted" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sink.status(tid) == "interrupted"
    [segment] = sink.generated(tid)
    assert segment.finish_reason == "abort" and 3 <= len(segment.tokens) < 200
    assert engine.in_flight == 0
    # The server keeps serving.
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3).choices[0].finish_reason == "length"
