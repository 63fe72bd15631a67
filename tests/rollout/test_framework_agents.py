"""The shipped tool-using example agents, written with real agent frameworks installed from PyPI (plain
`openai`, the OpenAI Agents SDK on chat completions and on its default Responses model, LangChain's
`bind_tools`), run unmodified as agent programs against a live endpoint: the model's tool call (written by
a test engine that replies in Qwen2.5's tool format, with the tokenizer and chat template of a tiny model
folder) reaches the framework as a call, the framework runs the tool and sends the result back, and the
final answer is judged by the task. Every call of the episode is in its trajectory. The last test runs all
four, in turn, as the agent program of an RL run launched on the dev cluster, on vLLM and an agent host."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from sfhpc.config.recipe import AgentSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi, new_run_token
from sfhpc.endpoint.tool_parsers import HermesParser
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.model.hf_folder import build_hf_model
from sfhpc.rollout.agent_process import AgentPrograms
from sfhpc.rollout.supervise import play_or_fail
from sfhpc.tasks.base import Episode, Problem, StepResult, Task
from tests.conftest import RECIPES
from tests.endpoint.conftest import ReplyingEngine

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "(2 + 3) * 4"}}\n</tool_call>'


class SumEpisode(Episode):
    def __init__(self, answer: int) -> None:
        self.answer = answer

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": "what is (2 + 3) * 4? use the calculator"}]

    def step(self, reply: str) -> StepResult:
        return StepResult(done=True, reward=float(reply.strip() == str(self.answer)))


class SumTask(Task):
    name = "sum"

    def sample(self, rng: random.Random) -> Problem:
        return Problem("20", 20)

    def episode(self, problem: Problem) -> Episode:
        return SumEpisode(problem.data)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder: Path = build_hf_model(tmp_path_factory.mktemp("qwen-tools"), "qwen2", chat_format="qwen2_tools", layers=1)
    return HFTokenizer.from_folder(folder)


@pytest.fixture
def served(tokenizer: HFTokenizer) -> Iterator[tuple[EndpointServer, TrajectoryManager, ReplyingEngine]]:
    engine = ReplyingEngine([tokenizer.encode(text) + [tokenizer.chat_stop_ids[0]] for text in (CALL, "20")])
    manager = TrajectoryManager()
    api = OpenAIApi(AgentEndpoint(engine, manager), model_name="policy", tokenizer=tokenizer, token=new_run_token())
    with EndpointServer(api) as server:
        yield server, manager, engine


@pytest.mark.parametrize("command", [("calculator_openai.py",), ("calculator_agents_sdk.py", "chat"),
                                     ("calculator_agents_sdk.py", "responses"),
                                     ("calculator_agents_sdk.py", "responses", "stream"), ("calculator_langchain.py",)],
                         ids=["openai", "agents-sdk-chat", "agents-sdk-responses", "agents-sdk-streamed",
                              "langchain"])
def test_a_framework_agent_calls_the_tool_and_answers(
        command: tuple[str, ...], tokenizer: HFTokenizer,
        served: tuple[EndpointServer, TrajectoryManager, ReplyingEngine]) -> None:
    server, manager, engine = served
    script, *args = command
    # As the recipes write it: a bare python3 (sfhpc's interpreter, which has the frameworks) and a path
    # relative to the recipe's folder.
    spec = AgentSpec(command=("python3", f"agents/{script}", *args), workers=1)
    runner = AgentPrograms(spec, recipe_source=str(RECIPES / "guess-number-agent.yaml"),
                           episodes=server.api.episodes, url_of=server.episode_url, model="policy")
    task = SumTask()

    async def episode() -> object:
        return await play_or_fail(lambda tell: runner.play(task, task.sample(random.Random(0)), group="g",
                                                           max_tokens=64, on_trajectory=tell),
                                  manager, task=task.name, group="g", timeout_s=60)
    outcome = server.call(episode(), timeout=120)
    assert outcome is not None, "the episode failed (see the log above)"
    assert outcome.reward == 1.0 and not engine.replies  # both scripted replies were asked for
    trajectory = manager.trajectory(outcome.trajectory_id)
    text = tokenizer.decode(trajectory.context(), skip_special=False)
    # One trajectory holds both calls: the tool call, the framework's tool result, the answer.
    assert [tokenizer.decode(r, skip_special=False) for r, _ in trajectory.replies()] == [
        CALL + "<|im_end|>", "20<|im_end|>"]
    assert "<tool_response>\n20\n</tool_response>" in text and '"name": "calculate"' in text
    assert trajectory.history_mismatches == 0
    assert server.api.health()["tool_calls"] == 1


RUN = """\
name: frameworks
seed: 1
model: {{build: {{chat_format: brief_tools, warm_start_steps: 300, layers: 2, hidden_size: 128, heads: 2}}}}
pipeline: {{mode: sync}}
algorithm: {{group_size: 4, temperature: 0.5}}   # the warm-started format, rarely a call cut short
budgets: {{steps: 1, prompts_per_step: 4, max_failed_fraction: 0.5}}
task: {{name: arith-tool, options: {{tools: calculator}}}}
agent: {{command: [python3, {dispatcher}, {log}], workers: 4, timeout_s: 120}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
  agents:     {{tags: [cpu], nodes: 1}}
launch: {{time_minutes: 24}}
output_dir: {runs}
"""


@pytest.mark.slurm
@pytest.mark.vllm
def test_the_framework_examples_play_inside_a_slurm_run_on_vllm(slurm_cluster: str, tmp_path: Path) -> None:
    """The examples, each in turn, play the episodes of a run launched on the dev cluster, from an agent
    host on a node of its own, against vLLM on the rollout node: a policy warm-started on `arith-tool`'s
    calculator calls, which every example offers as its own `calculate` tool."""
    import re

    from sfhpc.data.store_reader import open_store
    from tests.conftest import run_sfhpc

    log = tmp_path / "played.txt"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RUN.format(dispatcher=Path(__file__).parent / "agents" / "any_framework.py", log=log,
                                 runs=tmp_path / "runs"))
    done = run_sfhpc("launch", str(recipe), "--wait", "--timeout", "1500", timeout=1560)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    [host] = [p.stem for p in (run_dir / "agent-hosts").glob("*.json")]
    ranks = json.loads((run_dir / "launch_report.json").read_text())["ranks"]
    assert host.rsplit("-", 1)[0] not in {r["node"] for r in ranks}  # the agent host has a node of its own
    played = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    assert len(played) >= 16 and min(played.count(e) for e in set(played)) >= 3
    assert set(played) == {"calculator_openai.py", "calculator_agents_sdk.py responses",
                           "calculator_agents_sdk.py chat", "calculator_langchain.py",
                           "calculator_agents_sdk.py responses stream"}
    tokenizer = HFTokenizer.from_folder(run_dir / "model")
    store = open_store(run_dir / "trajectories.h5")
    assert [t.fail_reason for t in store.trajectories("failed")] == []
    consumed = list(store.trajectories("consumed"))
    assert len(consumed) == 16
    with_calls = 0
    for trajectory in consumed:
        replies = [tokenizer.decode(tokens, skip_special=False) for tokens, _ in trajectory.replies()]
        parsed = HermesParser({"calculate"}).parse(replies[0].removesuffix("<|end|>"))
        if parsed.calls:
            # The framework ran the call and sent its result back: a tool message, then the next reply, all in
            # the one trajectory. (A reply that begins a call it does not finish is content: the answer.)
            with_calls += 1
            assert len(replies) >= 2 and "observation" in [s.kind for s in trajectory.segments]
            assert [c.name for c in parsed.calls] == ["calculate"]
    # At most two episodes without a call: every example (three episodes or more each) ran calls.
    assert with_calls >= 14, with_calls
