"""Agent programs against a live endpoint: real subprocesses that use only the `openai` package, a real
HTTP server with the run's token, the deterministic test engine and the real trajectory manager."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sfhpc.config.recipe import AgentSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi, new_run_token
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.engine.tokenizer import ByteTokenizer
from sfhpc.rollout.agent_process import AgentPrograms, reward_line, turn_rewards_of
from sfhpc.rollout.supervise import play_or_fail
from sfhpc.tasks.base import Problem
from sfhpc.tasks.guess_number import GuessNumberTask
from tests.conftest import assert_one_line_error, run_sfhpc
from tests.rollout.conftest import MODEL

AGENT = Path(__file__).parent / "agents" / "guess_agent.py"
TASK = GuessNumberTask(max_turns=4)


def programs(server: EndpointServer, *args: str, workers: int = 4, **keys: Any) -> AgentPrograms:
    spec = AgentSpec(command=(sys.executable, str(AGENT), *args), workers=workers, answer_to_program=True, **keys)
    return AgentPrograms(spec, recipe_source=str(AGENT), episodes=server.api.episodes, url_of=server.episode_url,
                         model=MODEL)


def play(server: EndpointServer, manager: TrajectoryManager, runner: AgentPrograms, secret: int, *,
         timeout_s: float = 60, group: str = "g", heard: list[str] | None = None, seed: int | None = None) -> Any:
    """One supervised episode on the server's loop, as a rollout rank plays it; `heard` gets its trajectory id."""
    def on_trajectory(tid: str, tell: Callable[[str], None]) -> None:
        tell(tid)
        if heard is not None:
            heard.append(tid)

    async def supervised() -> Any:
        async with runner.slots:
            return await play_or_fail(
                lambda tell: runner.play(TASK, Problem(str(secret), secret), group=group, max_tokens=1,
                                         on_trajectory=lambda tid: on_trajectory(tid, tell), seed=seed),
                manager, task=TASK.name, group=group, timeout_s=timeout_s)
    return server.call(supervised(), timeout=timeout_s + 30)


def test_a_multi_turn_program_records_every_turn_and_the_verifier_judges_its_last_reply(
        server: EndpointServer, manager: TrajectoryManager) -> None:
    tokenizer = ByteTokenizer()
    outcomes = {secret: play(server, manager, programs(server), secret) for secret in (2, 7)}
    for secret, outcome in outcomes.items():
        assert outcome is not None
        record = manager.trajectory(outcome.trajectory_id)
        assert record.status == "finished" and record.task == "guess-number"
        replies = [tokenizer.decode(s.tokens) for s in record.segments if s.generated]
        # One generated segment per call, the program's hints between them: every turn is on one branch.
        assert len(replies) == outcome.turns >= 1
        assert [s.kind for s in record.segments] == ["prompt"] + ["generated", "observation"] * (outcome.turns - 1) \
            + ["generated"]
        assert len(record.branch()) == len(record.segments)
        found = replies[-1] == str(secret)
        assert outcome.turns == (replies.index(str(secret)) + 1 if found else 4)
        assert record.reward == outcome.reward == (1.0 if found else 0.0)
    assert len(manager.ids()) == 2 and not server.api.episodes  # both episodes closed


def test_the_programs_own_reward_wins_over_the_verifier(server: EndpointServer, manager: TrajectoryManager) -> None:
    printed = play(server, manager, programs(server, "--report", "stdout"), 5)
    posted = play(server, manager, programs(server, "--report", "post", reward_source="post"), 5)
    assert printed.reward in (10.0, 11.0) and posted.reward in (20.0, 21.0)
    assert manager.trajectory(printed.trajectory_id).reward == printed.reward
    assert server.api.episodes.rewards_refused == 0


def test_a_posted_reward_is_refused_unless_the_recipe_takes_it(server: EndpointServer, manager: TrajectoryManager,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # Code the model wrote and the program ran could post 1.0 for itself: under the default reward
    # source (stdout, then the verifier) the endpoint answers 403 and the episode fails with that reason.
    assert play(server, manager, programs(server, "--report", "post"), 5) is None
    assert server.api.episodes.rewards_refused == 1
    (reason,) = manager.fail_reasons()
    assert "the endpoint refused its last call: 403 this run does not take rewards posted" in reason, reason
    refused = [r.getMessage() for r in caplog.records if "posted a reward, refused" in r.getMessage()]
    assert len(refused) == 1, refused
    # Under reward_source "verifier" a printed reward line is only chatter: the verifier judges.
    judged = play(server, manager, programs(server, "--report", "stdout", reward_source="verifier"), 5)
    assert judged is not None and judged.reward in (0.0, 1.0)


def test_a_crashing_program_fails_its_episode_with_the_reason(server: EndpointServer,
                                                               manager: TrajectoryManager) -> None:
    heard: list[str] = []
    assert play(server, manager, programs(server, "--crash-on", "4"), 4, heard=heard) is None
    (tid,) = heard  # the trajectory its first call started is the one failed
    assert manager.status(tid) == "failed" and manager.counts()["failed"] == 1
    reason = manager.fail_reasons()[0]
    assert reason.startswith("AgentProgramFailed: the agent program exited with status 1; its stderr ends: "
                             "RuntimeError: agent crashed on purpose after guessing"), reason


def test_a_hanging_program_is_killed_with_its_process_group(server: EndpointServer, manager: TrajectoryManager,
                                                            tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    start = time.monotonic()
    heard: list[str] = []
    assert play(server, manager, programs(server, "--hang-on", "6", "--pid-file", str(pids)), 6,
                timeout_s=4, heard=heard) is None
    assert time.monotonic() - start < 15
    assert manager.fail_reasons() == ["timed out after 4 s"]
    (tid,) = heard
    assert manager.status(tid) == "failed"
    program, child = map(int, pids.read_text().split())
    assert program != child
    for pid in (program, child):  # the program and the child it started are gone
        assert not alive(pid)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a killed child nobody has reaped yet is a zombie: dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_program_that_never_calls_fails_and_workers_bound_concurrency(server: EndpointServer,
                                                                       manager: TrajectoryManager,
                                                                       tmp_path: Path) -> None:
    log = tmp_path / "spans"
    script = tmp_path / "idle.py"
    script.write_text(f"import time\nstart = time.time()\ntime.sleep(0.5)\n"
                      f"open({str(log)!r}, 'a').write(f'{{start}} {{time.time()}}\\n')\n")
    spec = AgentSpec(command=(sys.executable, str(script)), workers=2)
    runner = AgentPrograms(spec, recipe_source=str(script), episodes=server.api.episodes,
                           url_of=server.episode_url, model=MODEL)

    async def four() -> list[Any]:
        async def one(i: int) -> Any:
            async with runner.slots:
                return await play_or_fail(
                    lambda cb: runner.play(TASK, Problem("1", 1), group=f"g{i}", max_tokens=1, on_trajectory=cb),
                    manager, task=TASK.name, group=f"g{i}", timeout_s=30)
        return list(await asyncio.gather(*(one(i) for i in range(4))))

    assert server.call(four(), timeout=60) == [None] * 4
    assert manager.counts()["failed"] == 4
    assert manager.fail_reasons() == ["AgentProgramFailed: the agent program ended its episode without a reply from "
                                      "the endpoint: it must call the OpenAI API at the episode's base_url "
                                      "($OPENAI_BASE_URL)"]
    spans = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    assert len(spans) == 4
    running = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert running == 2  # at most `workers` at once, and the slots were used


def test_reward_lines() -> None:
    assert reward_line('{"reward": 1}') == 1.0 and reward_line(' {"reward": -0.5, "why": "x"}\n') == -0.5
    for line in ("reward: 1", '{"reward": true}', '{"reward": "1"}', '{"reward": NaN}', "[1]", "{"):
        assert reward_line(line) is None


def test_an_agent_command_that_does_not_exist_is_one_line_before_any_job(tmp_path: Path) -> None:
    body = ("name: bad-agent\ntask: {name: guess-number}\nagent: {command: [%s]}\n"
            "roles:\n  controller: {place_with: trainer}\n  trainer: {tags: [train], nodes: 1}\n"
            "  rollout: {tags: [rollout], nodes: 1}\n" f"output_dir: {tmp_path / 'runs'}\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(body % "./missing-agent.py")
    line = assert_one_line_error(run_sfhpc("run", str(recipe)), "agent.command",
                                 f"program {tmp_path / 'missing-agent.py'} does not exist")
    assert str(recipe) in line
    (tmp_path / "plain.py").write_text("print(1)\n")
    recipe.write_text(body % "./plain.py")
    assert_one_line_error(run_sfhpc("run", str(recipe)), "is not executable")
    recipe.write_text(body % "no-such-agent-program")
    assert_one_line_error(run_sfhpc("run", str(recipe)), "program 'no-such-agent-program' is not on PATH")
    assert not (tmp_path / "runs").exists()


def test_episode_input_is_json_with_the_tasks_opening(server: EndpointServer, manager: TrajectoryManager,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump = tmp_path / "input.json"
    script = tmp_path / "dump.py"
    script.write_text(f"import sys, os\nopen({str(dump)!r}, 'w').write(sys.stdin.read())\n"
                      f"open({str(dump)!r} + '.env', 'w').write(' '.join(os.environ[k] for k in ('OPENAI_BASE_URL', "
                      f"'OPENAI_API_KEY', 'OPENAI_MODEL', 'OPENAI_AGENTS_DISABLE_TRACING', 'LANGSMITH_TRACING')))\n")
    # A bare python3 is sfhpc's own interpreter, whatever PATH holds (a shell without the venv activated).
    monkeypatch.setenv("PATH", str(tmp_path))
    runner = AgentPrograms(AgentSpec(command=("python3", str(script))), recipe_source=str(script),
                           episodes=server.api.episodes, url_of=server.episode_url, model=MODEL)
    assert runner.runner.command[0] == sys.executable  # type: ignore[attr-defined]
    play(server, manager, runner, 3, seed=1234)
    data = json.loads(dump.read_text())
    assert data["task"] == "guess-number" and data["model"] == MODEL and data["max_tokens"] == 1
    assert data["seed"] == 1234  # the episode's ticket's, for a program that draws at random
    assert data["messages"] == [{"role": "user", "content": "guess 0-9"}]
    assert data["problem"] == {"key": "3"}  # its data holds the answer: only with agent.answer_to_program
    url, key, model, no_agents_traces, no_langsmith = Path(str(dump) + ".env").read_text().split()
    # The episode's own key, not the run's token.
    assert url == f"http://127.0.0.1:{server.port}/episodes/{data['episode_id']}/v1" and key == data["api_key"]
    assert key != server.token
    assert (model, no_agents_traces, no_langsmith) == (MODEL, "1", "false")


def test_a_program_reaches_an_endpoint_bound_to_all_addresses_by_host_name(manager: TrajectoryManager) -> None:
    """What an agent on another node does: the URL names this node, not loopback, and the run's token is
    required there too."""
    import socket

    import httpx

    engine = ScriptedEngine(seed=3, vocab=tuple(range(ord("0"), ord("9") + 1)), max_model_len=256)
    api = OpenAIApi(AgentEndpoint(engine, manager), model_name=MODEL, token=new_run_token())
    with EndpointServer(api, host="0.0.0.0") as server:
        assert server.episode_url("x").startswith(f"http://{socket.gethostname()}:{server.port}/")
        outcome = play(server, manager, programs(server, "--turns", "2"), 8)
        assert outcome is not None and manager.trajectory(outcome.trajectory_id).status == "finished"
        episode = server.api.episodes.open(task="t")
        anonymous = httpx.post(f"{server.episode_url(episode.id)}/chat/completions",
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert anonymous.status_code == 401


def test_long_output_keeps_draining_and_the_last_reward_line_counts() -> None:
    import os

    from sfhpc.rollout.agent_process import LINE_LIMIT, run_program

    script = "\n".join(["import sys", "print('{\"reward\": 1}')", f"print('x' * {2 * LINE_LIMIT})",
                        f"sys.stderr.write('e' * {3 * LINE_LIMIT} + '\\nlast words\\n')",
                        "print('{\"reward\": 2}')", "sys.exit(3)"])
    run = asyncio.run(run_program((sys.executable, "-c", script), env=os.environ, stdin="", cwd=None))
    assert (run.returncode, run.reward, list(run.stderr)) == (3, 2.0, ["last words"])
    assert run.failure() == "the agent program exited with status 3; its stderr ends: last words"


def test_the_shipped_agent_recipe_is_runnable_and_its_program_found_beside_it() -> None:
    from sfhpc.config import load_cluster_map, load_recipe
    from sfhpc.plan.resolve import resolve
    from sfhpc.rl.program import check_runnable
    from tests.conftest import RECIPES

    recipe = load_recipe(RECIPES / "guess-number-agent.yaml")
    check_runnable(recipe)
    assert resolve(recipe, load_cluster_map(RECIPES / "cluster-dev.yaml")).world_size == 3
    assert recipe.agent is not None and recipe.agent.command[1] == "agents/guess_number.py"
    assert (RECIPES / recipe.agent.command[1]).is_file()  # the program runs in the recipe's folder


def test_the_shipped_example_program_plays_and_reports_its_reward(server: EndpointServer,
                                                                  manager: TrajectoryManager) -> None:
    from tests.conftest import RECIPES

    recipe = RECIPES / "guess-number-agent.yaml"
    spec = AgentSpec(command=(sys.executable, "agents/guess_number.py"),  # this interpreter has `openai`
                     answer_to_program=True)
    runner = AgentPrograms(spec, recipe_source=str(recipe), episodes=server.api.episodes, url_of=server.episode_url,
                           model=MODEL)
    outcome = play(server, manager, runner, 4)
    record = manager.trajectory(outcome.trajectory_id)
    replies = [ByteTokenizer().decode(s.tokens) for s in record.segments if s.generated]
    found = "4" in replies
    assert len(replies) == outcome.turns == (replies.index("4") + 1 if found else 8)
    assert outcome.reward == pytest.approx(1.0 - 0.1 * (outcome.turns - 1) if found else 0.0)
    # Its end line rewards each guess too: 1 when the hints before it allowed it (the secret is 4).
    low, high, allowed = 0, 9, []
    for reply in replies:
        number = int(reply.strip()) if reply.strip().isascii() and reply.strip().isdigit() else None
        allowed.append(1.0 if number is not None and low <= number <= high else 0.0)
        if number is not None:
            low, high = (max(low, number + 1), high) if number < 4 else (low, min(high, number - 1))
    assert outcome.turn_rewards == tuple(allowed) and len(allowed) == outcome.turns


def test_turn_rewards_of_an_end_line() -> None:
    assert turn_rewards_of({"reward": 1, "turn_rewards": [1, 0, 0.5]}) == (1.0, 0.0, 0.5)
    for value in ({"reward": 1}, {"turn_rewards": [1, "0"]}, {"turn_rewards": [True]}, {"turn_rewards": 1},
                  {"turn_rewards": [float("nan")]}, None):
        assert turn_rewards_of(value) == ()


def test_a_cut_program_episode_is_aborted_and_its_replay_completes_the_group(manager: TrajectoryManager) -> None:
    """What a rollout rank does with an agent program's episode that a restart cut: the old trajectory is
    aborted (kept, never trained on) and a fresh one joins the same group, which then trains whole."""
    kept = manager.start([1, 2], task="guess-number", group="g")
    cut = manager.start([1, 2], task="guess-number", group="g")
    manager.add_generated(kept, [3], [-0.5], 0, finish_reason="stop")
    manager.finish(kept, 1.0)
    manager.add_generated(cut, [4], [-0.7], 0, finish_reason="abort")
    manager.interrupt(cut)
    manager.abort(cut)
    again = manager.start([1, 2], task="guess-number", group="g")
    manager.add_generated(again, [5], [-0.2], 0, finish_reason="stop")
    manager.finish(again, 0.0)
    batch = manager.take_batch(1, 1, group_size=2)
    assert batch is not None and sorted(t.id for t in batch.trajectories) == sorted([kept, again])
    assert manager.status(cut) == "aborted" and manager.counts()["failed"] == 0


SERVING_AGENT = """
import json, os, sys, time
import openai
for line in sys.stdin:
    episode = json.loads(line)
    with open(sys.argv[1], "a") as log:
        log.write(os.readlink("/proc/self") + "\\n")  # its pid on the node (inside a PID namespace it is 1)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
    client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=episode["messages"], max_tokens=1)
    secret = episode["problem"]["data"]
    if secret == 3:
        os._exit(3)  # dies before its episode's end line
    if secret == 5:
        time.sleep(600)  # never ends its episode
    print("a line of its own", flush=True)
    print(json.dumps({"episode_id": episode["episode_id"], "reward": secret / 10}), flush=True)
"""


def test_serving_programs_play_episodes_one_after_another_and_a_broken_one_is_replaced(
        server: EndpointServer, manager: TrajectoryManager, tmp_path: Path) -> None:
    script, log = tmp_path / "serving.py", tmp_path / "pids"
    script.write_text(SERVING_AGENT)
    runner = AgentPrograms(AgentSpec(command=("python3", str(script), str(log)), workers=2, serve=True,
                                     answer_to_program=True),
                           recipe_source=str(script), episodes=server.api.episodes, url_of=server.episode_url,
                           model=MODEL)

    def pids() -> list[int]:
        return [int(p) for p in log.read_text().split()]

    async def several(secrets: list[int]) -> list[Any]:
        return list(await asyncio.gather(*(supervised(s) for s in secrets)))

    async def supervised(secret: int) -> Any:
        async with runner.slots:
            return await play_or_fail(
                lambda tell: runner.play(TASK, Problem(str(secret), secret), group=f"g{secret}", max_tokens=1,
                                         on_trajectory=tell),
                manager, task=TASK.name, group=f"g{secret}", timeout_s=10)

    outcomes = server.call(several([1, 2, 4, 6, 7, 8]), timeout=120)
    # Six episodes, rewards from their end lines, played by the two programs of the two slots.
    assert [o.reward for o in outcomes] == [0.1, 0.2, 0.4, 0.6, 0.7, 0.8]
    assert len(pids()) == 6 and len(set(pids())) == 2
    assert manager.counts()["finished"] == 6
    # A program that dies mid-episode fails that episode only; one that hangs is killed at the timeout;
    # the next episodes get new programs.
    assert server.call(several([3]), timeout=60) == [None]
    assert server.call(several([5]), timeout=60) == [None]
    [after] = server.call(several([9]), timeout=60)
    assert after is not None and after.reward == 0.9
    reasons = manager.fail_reasons()
    assert any("exited with status 3 before its episode's end line" in r for r in reasons), reasons
    assert any("timed out after 10 s" in r for r in reasons), reasons
    # The one that died, then the other slot's, which hung and was killed, then a new one.
    died, hung, new = pids()[-3:]
    assert len({died, hung, new}) == 3 and len(set(pids())) == 3 and not _alive(hung)
    server.call(_close(runner), timeout=10)
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in set(pids()))


async def _close(runner: AgentPrograms) -> None:
    await runner.close()


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a killed child not yet reaped is a zombie: not alive
        return stat.read().split()[2] != "Z"


TWO_AGENTS = """
import json, sys
import openai
episode = json.loads(sys.stdin.readline())
def agent(name):
    return openai.OpenAI(base_url=f"{episode['agents_base_url']}/{name}/v1", api_key=episode["api_key"], max_retries=0)
guess = agent("solver").chat.completions.create(model="m", messages=episode["messages"], max_tokens=1)
said = guess.choices[0].message.content
agent("checker").chat.completions.create(model="m", messages=[{"role": "user", "content": f"is {said} right?"}],
                                         max_tokens=1)
rewards = json.loads(sys.argv[1])
print(json.dumps({"episode_id": episode["episode_id"], "rewards": rewards}))
"""


def test_a_two_agent_episode_stores_two_trajectories_in_its_group_each_with_its_reward(
        server: EndpointServer, manager: TrajectoryManager, tmp_path: Path) -> None:
    from sfhpc.trainer.batch import TrainBatch
    from sfhpc.trainer.losses import group_advantages

    script = tmp_path / "two.py"
    script.write_text(TWO_AGENTS)

    def episode(rewards: dict[str, float]) -> Any:
        runner = AgentPrograms(AgentSpec(command=("python3", str(script), json.dumps(rewards))),
                               recipe_source=str(script), episodes=server.api.episodes, url_of=server.episode_url,
                               model=MODEL)
        return play(server, manager, runner, 4, group="g")

    first = episode({"solver": 1.0, "checker": 0.25})
    assert first is not None and len(first.others) == 1
    pairs = [(first.trajectory_id, first.reward), *first.others]
    records = [manager.trajectory(tid) for tid, _ in pairs]
    assert [(r.group, r.agent, r.status, r.reward) for r in records] == [
        ("g", "solver", "finished", 1.0), ("g", "checker", "finished", 0.25)]
    assert records[0].metadata["episode"] == records[1].metadata["episode"]
    assert all(r.num_generated == 1 for r in records)  # each agent's one call, in its own trajectory
    # The group is complete when its episodes are (group_size 2 = two episodes, four trajectories).
    assert manager.take_batch(0, 1, group_size=2) is None
    episode({"solver": 0.0, "checker": 0.75})
    batch = manager.take_batch(0, 1, group_size=2)
    assert batch is not None and len(batch.trajectories) == 4
    train = TrainBatch.from_trajectories(batch.trajectories)
    by_agent = {agent: [i for i, t in enumerate(batch.trajectories) if t.agent == agent]
                for agent in ("solver", "checker")}
    assert {train.groups[i] for i in by_agent["solver"]} == {"g/solver"}
    assert {train.groups[i] for i in by_agent["checker"]} == {"g/checker"}
    # Advantages compare a solver with the other episode's solver, a checker with the other's checker.
    advantages = group_advantages(train.rewards, train.groups)
    solver = sorted(float(advantages[i]) for i in by_agent["solver"])
    checker = sorted(float(advantages[i]) for i in by_agent["checker"])
    assert solver[0] < 0 < solver[1] and checker[0] < 0 < checker[1]
    assert solver == pytest.approx(checker, abs=1e-4)  # one winner and one loser in each, whatever the scale


def test_a_reply_of_empty_text_is_a_reply(manager: TrajectoryManager, tmp_path: Path) -> None:
    """A model may answer with its end-of-turn token alone: the episode played, and is judged on ''."""
    from sfhpc.engine import tokenizer as tk
    from tests.endpoint.conftest import ReplyingEngine

    script = tmp_path / "once.py"
    script.write_text("import openai\nopenai.OpenAI().chat.completions.create(model='m', "
                      "messages=[{'role': 'user', 'content': 'x'}], max_tokens=2)\n")
    api = OpenAIApi(AgentEndpoint(ReplyingEngine([[tk.END]]), manager), model_name=MODEL, token=new_run_token())
    with EndpointServer(api) as server:
        runner = AgentPrograms(AgentSpec(command=("python3", str(script))), recipe_source=str(script),
                               episodes=server.api.episodes, url_of=server.episode_url,
                               model=MODEL)
        outcome = play(server, manager, runner, 4)
    assert outcome is not None and outcome.reward == 0.0  # the verifier judged '' as a wrong guess
    assert manager.trajectory(outcome.trajectory_id).status == "finished"
