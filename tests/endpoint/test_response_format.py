"""``response_format`` and the Responses ``text.format``: the format is asked in the system message the model's
own template renders (so the trajectory holds exactly that prompt), the reply is returned as written and
checked, and the frameworks that ask for structured output (the OpenAI Agents SDK's ``output_type`` on both of
its model classes, LangChain's ``with_structured_output``) get their typed object from a reply in the format."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from pydantic import BaseModel

from sfhpc.endpoint.response_format import ResponseFormat
from tests.endpoint.conftest import SERVED_MODEL as MODEL
from tests.endpoint.conftest import Served

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "hour": {"type": "integer"}},
          "required": ["city", "hour"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "time", "schema": SCHEMA, "strict": True}}
ANSWER = '{"city": "paris", "hour": 12}'


class Time(BaseModel):
    city: str
    hour: int


def test_the_format_is_asked_in_the_system_message_and_each_reply_is_checked(qwen: Served) -> None:
    qwen.will_reply(ANSWER, '{"city": "paris"}', "noon", ANSWER)
    user = [{"role": "user", "content": "what time is it in paris?"}]
    instruction = ResponseFormat("time", SCHEMA).instruction()
    assert json.dumps(SCHEMA, separators=(",", ":")) in instruction

    reply = qwen.client.chat.completions.create(model=MODEL, messages=user, response_format=JSON_SCHEMA)
    assert reply.choices[0].message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    rendered = qwen.tok.apply_chat_template([{"role": "system", "content": instruction}, *user])
    context = qwen.context(reply.model_extra["trajectory_id"])
    assert context[:len(rendered)] == rendered  # the prompt the policy read is the template's, instruction in it
    assert qwen.api.health()["response_format_misses"] == 0

    # A reply without a required key, then one that is not JSON: returned as written, each counted.
    for text in ('{"city": "paris"}', "noon"):
        reply = qwen.client.chat.completions.create(model=MODEL, messages=user, response_format=JSON_SCHEMA)
        assert reply.choices[0].message.content == text
    assert qwen.api.health()["response_format_misses"] == 2

    # json_object, with a system message of the agent's own: the instruction ends it.
    system = [{"role": "system", "content": "You tell the time."}, *user]
    reply = qwen.client.chat.completions.create(model=MODEL, messages=system, response_format={"type": "json_object"},
                                                stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices) == ANSWER
    trajectory = qwen.sink.trajectory(list(qwen.sink.calls)[-1])
    expected = qwen.tok.apply_chat_template([{"role": "system", "content": "You tell the time.\n\n"
                                              + ResponseFormat().instruction()}, *user])
    assert [int(t) for t in trajectory.context()][:len(expected)] == expected
    assert qwen.api.health()["response_format_misses"] == 2


def test_agents_sdk_output_type_on_both_model_classes_and_langchain_structured_output(qwen: Served) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    qwen.will_reply(ANSWER, ANSWER, ANSWER)

    async def run_both() -> list[Any]:
        client = AsyncOpenAI(base_url=qwen.server.url, api_key="unused", max_retries=0)  # one loop: both runs
        outputs = []
        for model in (OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=client),
                      OpenAIResponsesModel(model="gpt-4o-mini", openai_client=client)):
            agent = Agent(name="clock", instructions="You tell the time.", output_type=Time, model=model)
            outputs.append((await Runner.run(agent, "what time is it in paris?")).final_output)
        return outputs

    assert asyncio.run(run_both()) == [Time(city="paris", hour=12)] * 2
    chat = ChatOpenAI(model="gpt-4o-mini", base_url=qwen.server.url, api_key="unused", max_retries=0)
    assert chat.with_structured_output(Time).invoke("what time is it in paris?") == Time(city="paris", hour=12)
    # Each asked for the format by its name, in the prompt the policy read.
    prompts = [qwen.tok.decode(qwen.context(tid)) for tid in qwen.sink.calls]
    assert len(prompts) == 3
    assert all("following this JSON Schema" in prompt and '"hour"' in prompt for prompt in prompts), prompts
    assert qwen.api.health()["response_format_misses"] == 0


def test_bad_formats_are_one_400_naming_the_field_and_nothing_is_recorded(qwen: Served) -> None:
    user = [{"role": "user", "content": "time?"}]
    schema_named: Any = lambda name, schema=SCHEMA: {"type": "json_schema",  # noqa: E731
                                                     "json_schema": {"name": name, "schema": schema}}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("chat/completions", {"messages": user, "response_format": {"type": "xml"}}, "response_format"),
        ("chat/completions", {"messages": user, "response_format": {"type": "json_schema"}}, "response_format"),
        ("chat/completions", {"messages": user, "response_format": schema_named("has space")}, "response_format"),
        ("chat/completions", {"messages": user, "response_format": schema_named("t", {"type": 5})},
         "response_format"),
        ("completions", {"prompt": "time?", "response_format": {"type": "json_object"}}, "response_format"),
        ("responses", {"input": "time?", "text": {"format": {"type": "json_schema", "name": "t",
                                                             "schema": {"required": "city"}}}}, "text"),
        ("responses", {"input": "time?", "text": "json"}, "text"),
    ]
    for route, body, param in cases:
        response = httpx.post(f"{qwen.server.url}/{route}", json={"model": MODEL, **body})
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, param), (body, error)
        assert error["message"] and error["type"] == "invalid_request_error"
    assert not qwen.sink.calls
