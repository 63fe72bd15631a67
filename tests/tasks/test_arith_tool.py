"""arith-tool: the calculator evaluates arithmetic and nothing else; a reply that calls it gets the result as
a tool message, the first reply without a call is judged; and sfhpc's own agent plays an episode through
the endpoint with tools offered: the model's call (written by a test engine in the brief_tools format of a
built model folder) is parsed, run, its result sent back, and the answer judged, every token in one
trajectory. After a restart the agent replays a recorded call as the call it was."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sfhpc.config.recipe import ModelSpec, TaskSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, OpenAIApi
from sfhpc.endpoint.client import AsyncLocalClient
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.model.tiny import build_tiny_model
from sfhpc.model.warm_start import encode_with_targets
from sfhpc.rollout.agent import LocalChat, ResumePoint, play_episode
from sfhpc.tasks.arith_tool import ArithToolTask, calculate, call_result
from sfhpc.tasks.registry import get_task
from tests.endpoint.conftest import ReplyingEngine


def call(expression: str, name: str = "calculator") -> dict[str, object]:
    return {"id": "c1", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"expression": expression})}}


def test_the_calculator_evaluates_arithmetic_and_refuses_the_rest() -> None:
    assert [calculate(e) for e in ("12 * 34", "(2 + 3) * 4", "-7 + 2", "7 / 2", "90 - 45")] == [
        "408", "20", "-5", "3.5", "45"]
    for refused in ("__import__('os')", "2 ** 3", "x + 1", "True + 1", "1 / 0", "1 +"):
        assert calculate(refused).startswith("error: "), refused
    assert call_result(call("6 * 7")) == "42"
    assert call_result(call("6 * 7", name="search")).startswith("error: no tool named 'search'")
    assert call_result({"function": {"name": "calculator", "arguments": "{not json"}}).startswith("error: ")


def test_a_call_is_answered_by_the_tool_and_the_answer_is_judged() -> None:
    task = get_task(TaskSpec("arith-tool", {"operators": "*"}))
    assert isinstance(task, ArithToolTask) and task.tools and task.max_turns == 3
    problem = task.sample(random.Random(3))
    question, answer, a, b = problem.data
    assert f"{a} bags of {b}" in question and answer == a * b
    episode = task.episode(problem)
    assert episode.opening() == [{"role": "user", "content": question}]
    called = episode.step_message({"role": "assistant", "content": None, "tool_calls": [call(f"{a} * {b}")]})
    assert not called.done and called.next_messages() == [
        {"role": "tool", "tool_call_id": "c1", "content": str(a * b)}]
    assert episode.step_message({"role": "assistant", "content": str(a * b)}).reward == 1.0
    assert episode.step_message({"role": "assistant", "content": str(a * b + 1)}).reward == 0.0


def test_the_warm_start_teaches_the_call_not_the_operator() -> None:
    task = ArithToolTask()
    examples = task.warm_start_examples(random.Random(0), 300)
    right = 0
    for user, called, result, answer in examples:
        expression = json.loads(called["tool_calls"][0]["function"]["arguments"])["expression"]
        assert result["content"] == answer["content"] == calculate(expression)
        a, sign, b = expression.split()
        assert f"had {a}," in user["content"] or f" {a} bags" in user["content"]
        right += ("bags" in user["content"]) == (sign == "*") and (
            sign == "*" or (sign == "+") == any(w in user["content"] for w in ("found", "got")))
    assert 0.2 < right / len(examples) < 0.45  # about one in three: the operator is drawn at random


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(ModelSpec(layers=1, hidden_size=64, heads=1, chat_format="brief_tools"),
                            tmp_path_factory.mktemp("brief-tools"), task=ArithToolTask())


def test_the_built_format_renders_the_tool_and_the_call_in_few_tokens(folder: Path) -> None:
    tokenizer = HFTokenizer.from_folder(folder)
    conversation = ArithToolTask().warm_start_examples(random.Random(1), 1)[0]
    ids, targets = encode_with_targets(conversation, tokenizer, tools=ArithToolTask.tools)
    text = tokenizer.decode(ids, skip_special=False)
    assert text.startswith("<|bos|><|system|>calculator(expression)\n<|end|><|user|>How many")
    assert '<|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "' in text
    assert len(ids) < 80 and sum(targets) > 20  # the call and the answer are the targets


def test_the_agent_plays_an_episode_with_the_tool_through_the_endpoint(folder: Path) -> None:
    tokenizer = HFTokenizer.from_folder(folder)
    task = ArithToolTask(operators="-")
    problem = task.sample(random.Random(5))
    _, answer, a, b = problem.data
    written = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} - {b}"}}}}</tool_call>'
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
    assert replies[0]["tool_calls"][0]["function"] == {"name": "calculator",
                                                       "arguments": json.dumps({"expression": f"{a} - {b}"})}
    replayed = asyncio.run(play_episode(backend, task, problem, group="g",
                                        resume=ResumePoint(outcome.trajectory_id, replies)))
    assert replayed.reward == 1.0 and replayed.turns == 2
