"""Contained agent programs: what an episode's program starts ends with the episode (at its end, at its
timeout, at the death of the rank or agent host), in each containment mode this node allows; a program sees
a minimal environment and its episode's key alone; its limits hold.

Processes are found by a marker on their command line, read from /proc (the node's view: inside a PID
namespace a program's own pids mean nothing here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sfhpc.rollout.containment as containment
from sfhpc.config.recipe import AgentSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import EndpointServer
from sfhpc.errors import SfhpcError
from sfhpc.rollout.agent_host import AgentHostsClient
from sfhpc.rollout.agent_process import AgentPrograms, run_program
from sfhpc.rollout.containment import Containment, ProgramLimits, program_environment
from tests.rollout.conftest import MODEL
from tests.rollout.test_agent_hosts import start_host
from tests.rollout.test_agent_process import play

# A program that leaves a daemon behind: its grandchild calls setsid(), its parent exits, and it sleeps ten
# minutes holding the program's stdout and stderr. `exit`: the program then replies and ends; `hang`: it
# sleeps too. With OPENAI_BASE_URL (an episode's), it first makes one call.
ESCAPER = """
import json, os, sys, time
marker, mode = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", marker])
    os._exit(0)
os.wait()
if os.environ.get("OPENAI_BASE_URL"):
    import openai
    episode = json.load(sys.stdin)
    openai.OpenAI(max_retries=0).chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                                         messages=episode["messages"], max_tokens=1)
if mode == "hang":
    time.sleep(600)
print(json.dumps({"reward": 0.5}), flush=True)
"""


def marked(marker: str) -> list[int]:
    """The living processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state not in ("Z", "X"):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_for(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


@pytest.fixture
def cgroup2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cgroup v2 hierarchy this process may add cgroups to, mounted for the test (skipped where the node
    refuses the mount): what a delegated subtree gives a rank on a Slurm node."""
    root = tmp_path / "cgroup2"
    root.mkdir()
    if subprocess.run(["mount", "-t", "cgroup2", "none", str(root)], capture_output=True).returncode != 0:
        pytest.skip("no cgroup v2 can be mounted here")
    monkeypatch.setattr(containment, "CGROUP_FS", root)
    monkeypatch.setattr(containment, "_own_cgroup", lambda: root)
    containment._choose.cache_clear()
    try:
        yield root
    finally:
        containment._choose.cache_clear()
        for child in root.glob("sfhpc-*"):
            with contextlib.suppress(OSError):
                child.rmdir()
        subprocess.run(["umount", str(root)], capture_output=True)


MODES = ["session", "namespace", "cgroup"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "cgroup":
        request.getfixturevalue("cgroup2")
    try:
        Containment.choose(request.param)
    except SfhpcError as exc:
        pytest.skip(str(exc))
    return str(request.param)


def escaper(tmp_path: Path, marker: str, how: str, **keys: Any) -> AgentSpec:
    script = tmp_path / "escaper.py"
    script.write_text(ESCAPER)
    return AgentSpec(command=(sys.executable, str(script), marker, how), workers=1, **keys)


def test_a_daemonised_grandchild_ends_with_its_program_and_at_the_timeout(
        mode: str, server: EndpointServer, manager: TrajectoryManager, tmp_path: Path) -> None:
    # Containment costs an episode next to nothing: the end of a program is seen at once (a launcher that
    # hunted the node's /proc from inside a namespace had spent 5 s on every episode).
    started = time.monotonic()
    quick = asyncio.run(run_program((sys.executable, "-c", "print(1)"), env=dict(os.environ), stdin="", cwd=None,
                                    containment=Containment.choose(mode)))
    assert quick.returncode == 0 and time.monotonic() - started < 3, time.monotonic() - started
    # A program that ends, leaving the daemon: the episode ends with it (no wait on the daemon's pipes).
    marker = uuid.uuid4().hex
    start = time.monotonic()
    runner = AgentPrograms(escaper(tmp_path, marker, "exit", containment=mode), recipe_source=str(tmp_path),
                           episodes=server.api.episodes, url_of=server.episode_url, model=MODEL)
    outcome = play(server, manager, runner, 1, timeout_s=30)
    assert outcome is not None and outcome.reward == 0.5
    assert time.monotonic() - start < 10 and marked(marker) == []
    # One that hangs with it: failed at its timeout, the program and its daemon gone, within timeout + 10 s.
    marker = uuid.uuid4().hex
    start = time.monotonic()
    runner = AgentPrograms(escaper(tmp_path, marker, "hang", containment=mode), recipe_source=str(tmp_path),
                           episodes=server.api.episodes, url_of=server.episode_url, model=MODEL)
    assert play(server, manager, runner, 2, timeout_s=3) is None
    assert time.monotonic() - start < 3 + 10
    assert manager.fail_reasons() == ["timed out after 3 s"]
    assert wait_for(lambda: marked(marker) == [], 2), marked(marker)


RANK = """
import asyncio, os, sys
from sfhpc.rollout.agent_process import run_program
from sfhpc.rollout.containment import Containment
asyncio.run(run_program(sys.argv[1:], env=dict(os.environ), stdin="", cwd=None,
                        containment=Containment.choose(os.environ["MODE"])))
"""


def test_nothing_of_a_program_outlives_a_killed_rank(mode: str, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    script = tmp_path / "escaper.py"
    script.write_text(ESCAPER)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
    if mode == "cgroup":  # the rank's own probe must find the test's cgroup mount: the test makes it here
        pytest.skip("the cgroup mount is this process's; the launcher's cgroup kill is tested above")
    rank = subprocess.Popen([sys.executable, "-c", RANK, sys.executable, str(script), marker, "hang"],
                            env={**env, "MODE": mode, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        assert wait_for(lambda: len(marked(marker)) >= 2, 30), "the program and its daemon did not start"
        rank.send_signal(signal.SIGKILL)  # as when its node's OOM killer or a preemption takes the rank
        rank.wait()
        assert wait_for(lambda: marked(marker) == [], 10), marked(marker)
    finally:
        rank.kill()
        rank.wait()


def test_an_agent_host_ends_a_hanging_programs_daemon_at_the_timeout(server: EndpointServer,
                                                                     manager: TrajectoryManager,
                                                                     tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    (tmp_path / "escaper.py").write_text(ESCAPER)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: hosts\ntask: {{name: guess-number}}\nagent: {{command: [{sys.executable}, "
                      f"{tmp_path / 'escaper.py'}, {marker}, hang], timeout_s: 3}}\n"
                      "roles: {controller: {place_with: trainer}, trainer: {tags: [train]}, "
                      "rollout: {tags: [rollout]}, agents: {tags: [cpu]}}\n")
    host = start_host(recipe, tmp_path / "run", 0)
    try:
        assert host.stdout is not None and "worker(s) at http://127.0.0.1:" in host.stdout.readline()
        runner = AgentPrograms(AgentSpec(command=("python3", "x")), recipe_source=str(recipe),
                               episodes=server.api.episodes, url_of=server.episode_url, model=MODEL,
                               runner=AgentHostsClient(tmp_path / "run" / "agent-hosts"))
        start = time.monotonic()
        assert play(server, manager, runner, 2, timeout_s=60) is None  # the host bounds it, at 3 s
        assert time.monotonic() - start < 3 + 10
        (reason,) = manager.fail_reasons()
        assert "timed out after 3 s" in reason, reason
        assert wait_for(lambda: marked(marker) == [], 2), marked(marker)

        async def close() -> None:
            await runner.close()
        server.call(close(), timeout=10)
    finally:
        host.kill()
        host.wait()
    assert marked(marker) == []


ENV_DUMP = """
import json, os, sys
import openai
episode = json.load(sys.stdin)
json.dump({"env": dict(os.environ), "stdin": episode}, open(sys.argv[1], "w"))
openai.OpenAI(max_retries=0).chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=episode["messages"],
                                                     max_tokens=1)
"""


def test_a_program_sees_the_minimal_environment_and_its_episodes_key_alone(
        server: EndpointServer, manager: TrajectoryManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"WANDB_API_KEY": "wandb-secret", "HF_TOKEN": "hf-secret", "OPENAI_API_KEY": "sk-shell",
                        "HTTP_PROXY": "http://proxy.example:3128", "MY_SETTING": "on", "MY_TOKEN": "mine",
                        "SOMETHING_ELSE": "x"}.items():
        monkeypatch.setenv(name, value)
    script, dump = tmp_path / "env.py", tmp_path / "env.json"
    script.write_text(ENV_DUMP)
    spec = AgentSpec(command=(sys.executable, str(script), str(dump)), env=("MY_*", "HF_TOKEN"))
    runner = AgentPrograms(spec, recipe_source=str(script), episodes=server.api.episodes,
                           url_of=server.episode_url, model=MODEL)
    outcome = play(server, manager, runner, 7)
    assert outcome is not None
    seen = json.loads(dump.read_text())
    env, stdin = seen["env"], seen["stdin"]
    # Named exactly: passes; through a pattern: the setting, never the token; the rest of the shell: not at all.
    assert env["HF_TOKEN"] == "hf-secret" and env["MY_SETTING"] == "on"
    for absent in ("WANDB_API_KEY", "MY_TOKEN", "HTTP_PROXY", "SOMETHING_ELSE"):
        assert absent not in env, absent
    assert env["PATH"] == os.environ["PATH"]
    # Its key is its episode's (not the shell's, not the run's token); the problem's answer is not given.
    assert env["OPENAI_API_KEY"] == stdin["api_key"] not in ("sk-shell", server.token)
    assert stdin["problem"] == {"key": "7"} and "data" not in json.loads(env["SFHPC_EPISODE"])["problem"]
    assert env["TMPDIR"] == stdin["workdir"] == env.get("PWD", stdin["workdir"])
    # The same names through the function alone.
    assert program_environment(["MY_*"], {"MY_A": "1", "MY_API_KEY": "k", "PATH": "/bin", "AWS_X": "y",
                                          "HF_TOKEN": "t", "WANDB_API_KEY": "w"}) == {"MY_A": "1", "PATH": "/bin"}


def test_a_program_over_its_file_or_cpu_limit_fails_with_the_reason(tmp_path: Path) -> None:
    async def run(code: str, limits: ProgramLimits) -> str | None:
        result = await run_program((sys.executable, "-c", code), env=dict(os.environ), stdin="", cwd=str(tmp_path),
                                   limits=limits)
        return result.failure()

    big = asyncio.run(run("open('big', 'wb').write(bytes(2 << 20))", ProgramLimits(file_mb=1)))
    assert big is not None and "File too large" in big, big
    assert (tmp_path / "big").stat().st_size == 1 << 20
    busy = asyncio.run(run("while True: pass", ProgramLimits(cpu_s=1)))
    assert busy == "the agent program was killed by SIGXCPU", busy
    assert asyncio.run(run("print('fine')", ProgramLimits(file_mb=1, cpu_s=5))) is None


def test_a_refused_call_names_the_refusal_in_the_failure(server: EndpointServer, manager: TrajectoryManager,
                                                         tmp_path: Path) -> None:
    script = tmp_path / "refused.py"
    script.write_text("import json, os, sys\nimport openai\nepisode = json.load(sys.stdin)\n"
                      "try:\n    openai.OpenAI(max_retries=0).chat.completions.create(model=os.environ['OPENAI_MODEL'],"
                      " messages=episode['messages'], max_tokens=-3)\nexcept openai.BadRequestError:\n    pass\n")
    runner = AgentPrograms(AgentSpec(command=(sys.executable, str(script))), recipe_source=str(script),
                           episodes=server.api.episodes, url_of=server.episode_url, model=MODEL)
    assert play(server, manager, runner, 4) is None
    (reason,) = manager.fail_reasons()
    assert "without a reply from the endpoint; the endpoint refused its last call: 400 " in reason, reason
    assert "max_tokens" in reason, reason


def test_a_containment_the_node_cannot_give_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    containment._choose.cache_clear()
    monkeypatch.setattr(containment.shutil, "which", lambda name: None)
    monkeypatch.setattr(containment, "CGROUP_FS", tmp_path)  # no cgroup v2 here
    try:
        for wanted, says in (("namespace", "unshare"), ("cgroup", "cgroup v2")):
            with pytest.raises(SfhpcError) as refused:
                Containment.choose(wanted)
            assert "\n" not in str(refused.value) and says in str(refused.value)
        assert Containment.choose("auto").mode == "session"
    finally:
        containment._choose.cache_clear()
