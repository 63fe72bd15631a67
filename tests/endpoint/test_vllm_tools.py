"""With real vLLM: a tiny model in Qwen2.5's tool format (and one in Llama 3.1's), warm-started on two tool
conversations, calls the tool through the OpenAI client, gets the result back and answers; the trajectory is
token for token what the chat template renders for the conversation. The second conversation teaches the
model to write its arguments in JSON other than the template's (no spaces): the endpoint returns them
canonical, and the history the agent sends back then forks the trajectory, counted as a mismatch."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.engine.vllm_engine import VllmEngine
from sfhpc.model.hf_folder import build_hf_model
from sfhpc.model.warm_start import warm_start
from sfhpc.tasks.base import Episode, Problem, Task

pytestmark = pytest.mark.vllm
MODEL = "tiny-tools"
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "the time of day in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# city -> (the arguments as the model learns to write them, the tool's result, the final answer)
CITIES = {"paris": ({"city": "paris"}, "noon", "it is noon"),
          "rome": ('{"city":"rome"}', "night", "it is night")}


def conversation(city: str) -> list[dict[str, Any]]:
    arguments, result, answer = CITIES[city]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    return [{"role": "user", "content": f"what time is it in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
            {"role": "assistant", "content": answer}]


class TimeTask(Task):
    """Only its warm-start examples are used: the two conversations, with the tools rendered."""

    name = "time"
    tools = TOOLS

    def sample(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def episode(self, problem: Problem) -> Episode:
        raise NotImplementedError

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, Any]]]:
        return [conversation(rng.choice(sorted(CITIES))) for _ in range(count)]


@pytest.fixture(scope="module", params=[("qwen2", "qwen2_tools"), ("llama", "llama_tools")],
                ids=["qwen2.5", "llama3.1"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[HFTokenizer, EndpointServer, TrajectoryManager]]:
    architecture, chat_format = request.param
    folder = build_hf_model(tmp_path_factory.mktemp(chat_format) / "model", architecture, chat_format=chat_format,
                            max_seq_len=512)
    loss = warm_start(folder, TimeTask(), steps=150, batch_size=8, learning_rate=3e-3, save_dtype="float32")
    assert loss < 0.05, f"the warm start did not learn the two conversations (loss {loss:.3f})"
    manager = TrajectoryManager()
    endpoint = AgentEndpoint(ScriptedEngine(seed=0), manager)
    tokenizer = HFTokenizer.from_folder(folder)
    with EndpointServer(OpenAIApi(endpoint, model_name=MODEL, tokenizer=tokenizer)) as server:
        async def switch() -> VllmEngine:
            engine = VllmEngine.start(f"vllm-{chat_format}", folder, max_model_len=512, dtype="float32")
            await endpoint.replace_engine(engine)
            return engine
        engine = server.call(switch(), timeout=300)
        yield tokenizer, server, manager
        engine.shutdown()


def play(server: EndpointServer, city: str) -> tuple[str, list[dict[str, Any]], Any]:
    """The agent's side: ask, run the tool the model calls, send the result back, read the answer."""
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"what time is it in {city}?"}]
    first = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=48)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0].message
    [call] = first.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"city": city})
    tid = first.model_extra["trajectory_id"]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": CITIES[city][1]}]
    second = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=16, extra_headers={"X-Trajectory-Id": tid})
    return tid, messages, second.choices[0]


def test_a_generated_tool_call_round_trips_and_the_trajectory_is_the_templates_rendering(
        served: tuple[HFTokenizer, EndpointServer, TrajectoryManager]) -> None:
    tokenizer, server, manager = served
    tid, messages, answer = play(server, "paris")
    assert answer.message.content == "it is noon" and answer.finish_reason == "stop"
    rendered = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer.message.content}],
                                             add_generation_prompt=False, tools=TOOLS)
    context = [int(t) for t in manager.trajectory(tid).context()]
    # Up to the last reply's end-of-turn token: ChatML writes a newline after it, Llama 3 nothing.
    assert context == rendered[:len(context)] and tokenizer.decode(rendered[len(context):]).strip() == ""
    trajectory = manager.trajectory(tid)
    assert trajectory.history_mismatches == 0 and len(trajectory.replies()) == 2


def test_arguments_the_model_wrote_in_other_json_fork_the_trajectory_and_are_counted(
        served: tuple[HFTokenizer, EndpointServer, TrajectoryManager]) -> None:
    tokenizer, server, manager = served
    tid, _, answer = play(server, "rome")
    generated = [s for s in manager.trajectory(tid).segments if s.generated]
    assert '{"city":"rome"}' in tokenizer.decode(generated[0].tokens)  # what the model wrote, kept as written
    assert manager.trajectory(tid).history_mismatches == 1
