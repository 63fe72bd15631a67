"""Function tools on the endpoint, with a real Hugging Face tokenizer and chat template (a tiny folder built
here in Qwen2.5's and Llama 3.1's tool formats) and an engine that writes scripted replies token by token:
the OpenAI client offers tools, reads ``tool_calls`` (whole and streamed), sends results back, and the
trajectory holds exactly what the template renders for the conversation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sfhpc.endpoint.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, Parsed, parser_for_template
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.model.hf_folder import build_hf_model
from tests.endpoint.conftest import SERVED_MODEL as MODEL
from tests.endpoint.conftest import Served

TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "the time of day in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_model(tmp_path_factory.mktemp("llama-tools"), "llama", chat_format="llama_tools", layers=1)


def test_a_tool_call_is_parsed_answered_and_the_trajectory_is_what_the_template_renders(qwen: Served) -> None:
    qwen.will_reply(CALL, "it is noon in paris")
    messages: list[Any] = [{"role": "user", "content": "what time is it in paris?"}]
    # The agent's own model name is accepted: the run serves one policy.
    first = qwen.client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert first.model == MODEL and choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"city": "paris"})
    tid = first.model_extra["trajectory_id"]

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "noon"}]
    second = qwen.client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS,
                                                 extra_headers={"X-Trajectory-Id": tid})
    assert second.choices[0].message.content == "it is noon in paris"
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls

    # Token-exact: the trajectory is the template's rendering of the whole conversation, up to the last
    # reply's end-of-turn token (ChatML writes a newline after it, which no one generated).
    rendered = qwen.tok.apply_chat_template(messages + [{"role": "assistant", "content": "it is noon in paris"}],
                                            add_generation_prompt=False, tools=TOOLS)
    context = qwen.context(tid)
    assert context == rendered[:len(context)] and qwen.tok.decode(rendered[len(context):]) == "\n"
    trajectory = qwen.sink.trajectory(tid)
    assert trajectory.history_mismatches == 0 and len(trajectory.replies()) == 2
    assert qwen.api.health()["tool_calls"] == 1 and qwen.api.health()["tool_call_parse_failures"] == 0


def test_arguments_in_other_json_are_returned_canonical_and_the_mismatch_is_counted(qwen: Served) -> None:
    raw = '<tool_call>\n{"name":"get_time","arguments":{"city":"paris"}}\n</tool_call>'
    qwen.will_reply(raw, "noon")
    messages: list[Any] = [{"role": "user", "content": "what time is it in paris?"}]
    first = qwen.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.arguments == '{"city": "paris"}'
    tid = first.model_extra["trajectory_id"]
    generated = list(first.choices[0].model_extra["token_ids"])
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "noon"}]
    qwen.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                        extra_headers={"X-Trajectory-Id": tid})
    trajectory = qwen.sink.trajectory(tid)
    assert trajectory.history_mismatches == 1
    # The reply the policy wrote is kept whole as written; the current branch keeps of it only the tokens
    # before the first that differs, and holds the re-rendered rest as an observation, never trained on as
    # if the policy wrote it.
    assert any(list(s.tokens) == generated for s in trajectory.segments if s.generated)
    (received, _), (last, _) = trajectory.replies()  # each reply as its agent received it
    assert list(received) == generated
    kept = trajectory.context()[trajectory.token_turns() == 0]  # what the trained branch holds of it
    assert 0 < len(kept) < len(generated) and list(kept) == generated[:len(kept)]
    assert list(last) == qwen.tok.encode("noon") + [qwen.tok.chat_stop_ids[0]]


def test_streamed_tool_calls_hold_back_the_call_and_send_the_text_before_it(qwen: Served) -> None:
    qwen.will_reply("let me look " + CALL + "\n" + CALL.replace("paris", "rome"))
    stream = qwen.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "paris, rome?"}],
                                                 tools=TOOLS, stream=True)
    content, calls, finish = [], {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.content:
            content.append(delta.content)
        for piece in delta.tool_calls or []:
            calls.setdefault(piece.index, {"name": "", "arguments": ""})
            calls[piece.index]["name"] += piece.function.name or ""
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(content) == "let me look " and not any("<" in c for c in content)
    assert [(c["name"], json.loads(c["arguments"])["city"]) for c in calls.values()] == [
        ("get_time", "paris"), ("get_time", "rome")]
    assert finish == "tool_calls"


def test_replies_without_a_parsable_call_are_content_and_counted(qwen: Served) -> None:
    broken = '<tool_call>\n{"name": "get_time", "arguments": {"city": '
    qwen.will_reply(broken, CALL, CALL + "\n" + CALL)
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "time?"}], "tools": TOOLS}
    reply = qwen.client.chat.completions.create(**ask)
    assert reply.choices[0].message.content == broken and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    assert qwen.api.health()["tool_call_parse_failures"] == 1
    # tool_choice none: the tools are rendered, nothing is read from the reply.
    reply = qwen.client.chat.completions.create(**ask, tool_choice="none")
    assert reply.choices[0].message.content == CALL and reply.choices[0].finish_reason == "stop"
    # parallel_tool_calls false: one call per reply.
    reply = qwen.client.chat.completions.create(**ask, parallel_tool_calls=False)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_a_call_to_a_function_not_offered_is_content_and_counted(qwen: Served) -> None:
    lookup = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    qwen.will_reply(CALL)
    reply = qwen.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "time?"}],
                                                tools=lookup)
    assert reply.choices[0].message.content == CALL and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    health = qwen.api.health()
    assert health["tool_calls_unoffered"] == 1 and health["tool_calls"] == 0


def test_bad_tool_input_is_one_400_naming_the_field_and_nothing_is_recorded(qwen: Served) -> None:
    user = [{"role": "user", "content": "time?"}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "messages": user + [{"role": "tool", "content": "noon"}]}, "messages"),
        ({"tools": TOOLS, "messages": user + [{"role": "assistant", "tool_calls": [call]}]}, "messages"),
    ]
    for extra, param in cases:
        response = httpx.post(f"{qwen.server.url}/chat/completions", json={"model": MODEL, "messages": user, **extra})
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, param), (extra, error)
        assert error["message"] and error["type"] == "invalid_request_error"
    assert not qwen.sink.calls


def test_llama_json_tool_calls(llama_folder: Path) -> None:
    served = Served(llama_folder)
    try:
        served.will_reply('{"name": "get_time", "parameters": {"city": "paris"}}', "noon")
        messages: list[Any] = [{"role": "user", "content": "what time is it in paris?"}]
        first = served.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        [call] = first.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_time", '{"city": "paris"}')
        assert first.choices[0].finish_reason == "tool_calls"
        tid = first.model_extra["trajectory_id"]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "noon"}]
        served.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                              extra_headers={"X-Trajectory-Id": tid})
        rendered = served.tok.apply_chat_template(messages + [{"role": "assistant", "content": "noon"}],
                                                  add_generation_prompt=False, tools=TOOLS)
        assert served.context(tid) == rendered  # Llama 3 writes nothing after <|eot_id|>
        assert served.sink.trajectory(tid).history_mismatches == 0
    finally:
        served.server.stop()


def test_parsers_read_their_formats_and_are_chosen_from_the_template(qwen_folder: Path, llama_folder: Path) -> None:
    assert parser_for_template(HFTokenizer.from_folder(qwen_folder).chat_template) == "hermes"
    assert parser_for_template(HFTokenizer.from_folder(llama_folder).chat_template) == "llama3_json"
    assert parser_for_template("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    v3 = MistralParser("ab").parse('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    v11 = MistralParser("ab").parse('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}')
    assert [(c.name, c.arguments) for c in v3.calls] == [(c.name, c.arguments) for c in v11.calls] == [
        ("a", '{"x": 1}'), ("b", "{}")]
    assert MistralParser("ab").parse("[TOOL_CALLS][{\"name\": ").failed
    two = Llama3JsonParser("ab").parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                                   '{"name": "b", "arguments": {}}')
    assert [c.name for c in two.calls] == ["a", "b"] and two.content is None
    assert Llama3JsonParser("ab").parse("the answer is 4").calls == ()
    assert not Llama3JsonParser("ab").parse("the answer is 4").failed
    assert HermesParser({"get_time"}).parse(CALL + " trailing words").failed  # text after a call: not a finished call
    assert HermesParser({"get_time"}).held_from("let me look <tool_") == len("let me look ")
    assert Llama3JsonParser("ab").held_from('  {"na') == 0 and Llama3JsonParser("ab").held_from("plain") == 5
    # A call to a function the request did not offer is no call: a plain JSON answer stays content.
    answer = '{"name": "Alice", "age": 31}'
    assert Llama3JsonParser({"get_time"}).parse(answer) == Parsed(answer, unoffered=("Alice",))
    assert HermesParser({"lookup"}).parse(CALL) == Parsed(CALL, unoffered=("get_time",))
    assert MistralParser("a").parse('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}').unoffered == ("b",)


def test_the_responses_api_is_a_chat_turn_with_items(qwen: Served) -> None:
    qwen.will_reply(CALL, "it is noon")
    tool = {"type": "function", "name": "get_time", "description": "the time of day in a city",
            "parameters": TOOLS[0]["function"]["parameters"]}
    first = qwen.client.responses.create(model="any", instructions="be brief", input="time in paris?", tools=[tool])
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_time", {"city": "paris"})
    tid = first.model_extra["trajectory_id"]
    items: list[Any] = [{"role": "user", "content": "time in paris?"}, call.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": call.call_id, "output": "noon"}]
    second = qwen.client.responses.create(model="any", instructions="be brief", input=items, tools=[tool],
                                          extra_headers={"X-Trajectory-Id": tid})
    assert second.output_text == "it is noon" and second.status == "completed"
    assert second.usage.output_tokens == len(qwen.tok.encode("it is noon")) + 1  # and the end-of-turn token
    rendered = qwen.tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "time in paris?"},
         {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
             "name": "get_time", "arguments": {"city": "paris"}}}]},
         {"role": "tool", "content": "noon"}], tools=TOOLS)
    assert qwen.context(tid)[:len(rendered)] == rendered and qwen.sink.trajectory(tid).history_mismatches == 0
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"tools": [{"type": "web_search"}]}, "tools"), ({"input": []}, "input"),
                         ({"frequency_penalty": 1}, "frequency_penalty")]:
        response = httpx.post(f"{qwen.server.url}/responses", json={"model": "any", "input": "hi", **extra})
        assert (response.status_code, response.json()["error"]["param"]) == (400, param), extra


def test_streamed_responses_are_the_responses_apis_events(qwen: Served) -> None:
    """What the openai client's ``responses.stream`` and the Agents SDK's ``Runner.run_streamed`` read: the
    call as a function_call item, then the answer's text as deltas, each closed by ``response.completed``."""
    qwen.will_reply(CALL, "it is noon")
    tool = {"type": "function", "name": "get_time", "description": "the time of day in a city",
            "parameters": TOOLS[0]["function"]["parameters"]}
    with qwen.client.responses.stream(model="any", input="time in paris?", tools=[tool]) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_time", {"city": "paris"})
    tid = first.model_extra["trajectory_id"]
    items: list[Any] = [{"role": "user", "content": "time in paris?"}, call.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": call.call_id, "output": "noon"}]
    events = list(qwen.client.responses.create(model="any", input=items, tools=[tool], stream=True,
                                               extra_headers={"X-Trajectory-Id": tid}))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.completed"]
    assert text == "it is noon" and done.response.output_text == "it is noon"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert done.response.usage.output_tokens == len(qwen.tok.encode("it is noon")) + 1
    assert done.response.model_extra["trajectory_id"] == tid and qwen.sink.trajectory(tid).history_mismatches == 0
