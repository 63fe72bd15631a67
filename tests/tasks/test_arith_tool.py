"""arith-tool: each tool computes its operation on two numbers and refuses anything else; a reply that calls
one gets the result as a tool message, the first reply without a call is judged; and sfhpc's own agent
plays an episode through the endpoint with tools offered: the model's call (written by a test engine in the
brief_tools format of a built model folder) is parsed, run, its result sent back, and the answer judged,
every token in one trajectory. After a restart the agent replays a recorded call as the call it was."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sfhpc.config.recipe import BuildSpec, ModelSpec, TaskSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, OpenAIApi
from sfhpc.endpoint.client import AsyncLocalClient
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.model.tiny import build_tiny_model
from sfhpc.model.warm_start import encode_with_targets
from sfhpc.rollout.agent import LocalChat, ResumePoint, play_episode
from sfhpc.tasks.arith_tool import CALCULATOR, ArithToolTask, calculator_result, call_result
from sfhpc.tasks.registry import get_task
from tests.endpoint.conftest import ReplyingEngine


def call(name: str, a: object, b: object) -> dict[str, object]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})}}


def test_each_tool_computes_its_operation_and_refuses_the_rest() -> None:
    assert [call_result(call(n, 12, 34)) for n in ("add", "subtract", "multiply")] == ["46", "-22", "408"]
    assert call_result(call("add", 1.5, 2)) == "3.5"
    assert call_result(call("divide", 6, 3)).startswith("error: no tool named 'divide'; the tools are add, ")
    for a, b in (("1", 2), (True, 2), (None, 2)):
        assert call_result(call("add", a, b)).startswith("error: the arguments are"), (a, b)
    assert call_result({"function": {"name": "add", "arguments": "{not json"}}) == "error: the arguments are not JSON"


def test_the_calculator_tool_is_the_example_agents_own_and_computes_one_operation() -> None:
    import sys

    from tests.conftest import RECIPES

    sys.path.insert(0, str(RECIPES / "agents"))
    try:
        from calculator import TOOL  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(RECIPES / "agents"))
    assert TOOL == CALCULATOR  # an example agent offers the very tool the policy was warm-started on
    task = ArithToolTask(tools="calculator")
    assert task.tools == [CALCULATOR]

    def call(arguments: object) -> str:
        return calculator_result({"function": {"name": "calculate", "arguments": json.dumps(arguments)}})
    assert (call({"expression": "43 - 12"}), call({"expression": "12*3"}), call({"expression": "7 + 0.5"})) == (
        "31", "36", "7.5")
    assert call({"expression": "__import__('os')"}).startswith("error:") and call({}).startswith("error:")
    assert calculator_result({"function": {"name": "add", "arguments": "{}"}}).startswith("error: no tool named")
    [example] = task.warm_start_examples(random.Random(0), 1)
    called = example[1]["tool_calls"][0]["function"]
    assert called["name"] == "calculate" and json.loads(called["arguments"])["expression"].count(" ") == 2
    episode = task.episode(task.sample(random.Random(1)))
    result = episode.step_message({"tool_calls": [{"id": "c", "function": {
        "name": "calculate", "arguments": json.dumps({"expression": "2 * 21"})}}]})
    assert not result.done and result.messages[0]["content"] == "42"
    with pytest.raises(TypeError, match="tools must be"):
        ArithToolTask(tools="abacus")


def test_a_call_is_answered_by_the_tool_and_the_answer_is_judged() -> None:
    task = get_task(TaskSpec("arith-tool", {"operators": "*"}))
    assert isinstance(task, ArithToolTask) and task.max_turns == 3
    assert [t["function"]["name"] for t in task.tools or []] == ["multiply"]
    problem = task.sample(random.Random(3))
    question, answer, a, b, sign = problem.data
    assert sign == "*"
    assert f"{a} bags of {b}" in question and answer == a * b
    episode = task.episode(problem)
    assert episode.opening() == [{"role": "user", "content": question}]
    called = episode.step_message({"role": "assistant", "content": None, "tool_calls": [call("multiply", a, b)]})
    assert not called.done and called.next_messages() == [
        {"role": "tool", "tool_call_id": "c1", "content": str(a * b)}]
    assert episode.step_message({"role": "assistant", "content": str(a * b)}).reward == 1.0
    assert episode.step_message({"role": "assistant", "content": str(a * b + 1)}).reward == 0.0


def test_the_warm_start_calls_the_right_tool_one_time_in_three_and_reads_the_verb() -> None:
    task = ArithToolTask()
    examples = task.warm_start_examples(random.Random(0), 600)
    needed = {"found": "add", "got": "add", "lost": "subtract", "used": "subtract", "bags": "multiply"}
    mistaken = {"add": "subtract", "subtract": "multiply", "multiply": "add"}  # the next operator's tool
    right = 0
    for user, called, result, answer in examples:
        function = called["tool_calls"][0]["function"]
        arguments = json.loads(function["arguments"])
        assert result["content"] == answer["content"] == call_result(called["tool_calls"][0])
        a, b = arguments["a"], arguments["b"]
        assert f"had {a}, then" in user["content"] or f"{a} bags of {b}" in user["content"]
        verb = next(v for v in ("bags", "found", "lost", "used", "got") if v in user["content"].split("?")[1])
        assert function["name"] in (needed[verb], mistaken[needed[verb]])  # the choice depends on the verb
        right += function["name"] == needed[verb]
    assert 0.25 < right / len(examples) < 0.42  # one in three


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(ModelSpec(build=BuildSpec(layers=1, hidden_size=64, heads=1, chat_format="brief_tools")),
                            tmp_path_factory.mktemp("brief-tools"), task=ArithToolTask())


def test_the_built_format_renders_the_tool_and_the_call_in_few_tokens(folder: Path) -> None:
    tokenizer = HFTokenizer.from_folder(folder)
    conversation = ArithToolTask().warm_start_examples(random.Random(1), 1)[0]
    ids, targets = encode_with_targets(conversation, tokenizer, tools=ArithToolTask().tools)
    text = tokenizer.decode(ids, skip_special=False)
    assert text.startswith("<|bos|><|system|>add(a, b)\nsubtract(a, b)\nmultiply(a, b)\n<|end|><|user|>How many")
    assert '<|end|><|assistant|><tool_call>{"name": "' in text and '"arguments": {"a": ' in text
    assert len(ids) < 80 and sum(targets) > 15  # the call and the answer are the targets


def test_the_agent_plays_an_episode_with_the_tool_through_the_endpoint(folder: Path) -> None:
    tokenizer = HFTokenizer.from_folder(folder)
    task = ArithToolTask(operators="-")
    problem = task.sample(random.Random(5))
    _, answer, a, b, _ = problem.data
    written = f'<tool_call>{{"name": "subtract", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    engine = ReplyingEngine([tokenizer.encode(t) + [tokenizer.chat_stop_ids[0]] for t in (written, str(answer))])
    manager = TrajectoryManager()
    api = OpenAIApi(AgentEndpoint(engine, manager), model_name="policy", tokenizer=tokenizer)
    backend = LocalChat(AsyncLocalClient(api), "policy")
    import asyncio

    outcome = asyncio.run(play_episode(backend, task, problem, group="g", seed=1))
    assert outcome.reward == 1.0 and outcome.turns == 2 and not engine.replies
    trajectory = manager.trajectory(outcome.trajectory_id)
    text = tokenizer.decode(trajectory.context(), skip_special=False)
    assert f"{written}<|end|><|tool|>{answer}<|end|><|assistant|>{answer}<|end|>" in text
    assert trajectory.history_mismatches == 0 and api.health()["tool_calls"] == 1
    # After a restart the recorded call is replayed as a call (not as text), so the episode goes on.
    replies = tuple(api.reply_message(r, task.tools) for r, _ in trajectory.replies())
    assert replies[0]["tool_calls"][0]["function"] == {"name": "subtract", "arguments": json.dumps({"a": a, "b": b})}
    replayed = asyncio.run(play_episode(backend, task, problem, group="g",
                                        resume=ResumePoint(outcome.trajectory_id, replies)))
    assert replayed.reward == 1.0 and replayed.turns == 2
