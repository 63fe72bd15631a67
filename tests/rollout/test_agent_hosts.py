"""Agent hosts (an ``agents`` role): real host processes (`python -m sfhpc.rank.agent_host`) found through the
run folder's register, the rollout rank's client choosing among them, real agent programs calling back to a
live endpoint (the deterministic test engine), and the real trajectory manager. The whole run with a host
killed is `test_a_run_with_agent_hosts_survives_losing_one` (and, on the dev cluster, `test_agent_slurm.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sfhpc.config.recipe import AgentSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import open_store
from sfhpc.endpoint import EndpointServer
from sfhpc.rollout.agent_host import AgentHostsClient
from sfhpc.rollout.agent_process import AgentPrograms
from sfhpc.rollout.supervise import play_or_fail
from sfhpc.tasks.base import Problem
from tests.conftest import ROOT
from tests.rollout.conftest import MODEL
from tests.rollout.test_agent_process import TASK, alive
from tests.rollout.test_agent_run import AGENT, RECIPE, TEST_ENGINE

# By the secret: 1 plays; 2 takes more memory than the limit; 3 never ends. Every program notes where it ran.
PROGRAM = """
import json, os, sys, time
import openai
episode = json.load(sys.stdin)
with open(sys.argv[1], "a") as notes:
    # Pids as the node sees them (/proc is the node's, even in a PID namespace): its own and its ancestors'.
    pids = [int(os.readlink("/proc/self"))]
    while pids[-1] > 1:
        pids.append(int(open(f"/proc/{pids[-1]}/stat").read().rsplit(")", 1)[1].split()[1]))
    notes.write(json.dumps({"pid": pids[0], "ancestors": pids[1:], "cwd": os.getcwd(), "workdir": episode["workdir"],
                            "container": os.environ.get("IN_CONTAINER"), "secret": episode["problem"]["data"]}) + "\\n")
open("scratch.txt", "w").write("an episode's own file")
client = openai.OpenAI(max_retries=0)
client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=episode["messages"], max_tokens=1)
secret = episode["problem"]["data"]
if secret == 2:
    hog = bytearray(400 << 20)
if secret == 3:
    time.sleep(600)
print(json.dumps({"reward": 0.5}))
"""


def start_host(recipe: Path, run_dir: Path, index: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sfhpc.rank.agent_host", str(recipe), "--run-dir", str(run_dir),
                             "--index", str(index), "--bind", "127.0.0.1"], stdout=subprocess.PIPE, text=True)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    """Two agent hosts of a recipe whose program runs in a 'container' (an `env` prefix), with a memory limit."""
    script, notes = tmp_path / "program.py", tmp_path / "notes.jsonl"
    script.write_text(PROGRAM)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: hosts\ntask: {{name: guess-number}}\nagent: {{command: [{sys.executable}, program.py, "
                      f"{notes}], container: [env, IN_CONTAINER=yes], memory_mb: 300, timeout_s: 20, "
                      f"answer_to_program: true, workdir: {tmp_path / 'work'}}}\n"
                      "roles: {controller: {place_with: trainer}, trainer: {tags: [train]}, "
                      "rollout: {tags: [rollout]}, agents: {tags: [cpu]}}\n")
    run_dir = tmp_path / "run"
    started = [start_host(recipe, run_dir, i) for i in range(2)]
    try:
        for host in started:  # each says where it serves once it is registered
            assert host.stdout is not None and "worker(s) at http://127.0.0.1:" in host.stdout.readline()
        yield run_dir, started
    finally:
        for host in started:
            host.kill()
            host.wait()


def play_all(server: EndpointServer, manager: TrajectoryManager, programs: AgentPrograms,
             secrets: list[int]) -> list[Any]:
    async def one(secret: int) -> Any:
        async with programs.slots:
            return await play_or_fail(
                lambda tell: programs.play(TASK, Problem(str(secret), secret), group=f"g{secret}", max_tokens=1,
                                           on_trajectory=tell),
                manager, task=TASK.name, group=f"g{secret}", timeout_s=None)

    async def every() -> list[Any]:
        return list(await asyncio.gather(*(one(s) for s in secrets)))
    return server.call(every(), timeout=120)


def test_agent_hosts_play_episodes_in_folders_of_their_own_within_limits_and_losing_one_fails_only_its_own(
        server: EndpointServer, manager: TrajectoryManager, tmp_path: Path,
        hosts: tuple[Path, list[subprocess.Popen[str]]]) -> None:
    run_dir, (first, second) = hosts
    client = AgentHostsClient(run_dir / "agent-hosts")
    programs = AgentPrograms(AgentSpec(command=("python3", "x"), answer_to_program=True),
                             recipe_source=str(tmp_path / "recipe.yaml"),
                             episodes=server.api.episodes, url_of=server.episode_url, model=MODEL,
                             runner=client)
    assert sorted(h.name[-2:] for h in client.hosts()) == ["-0", "-1"]
    outcomes = play_all(server, manager, programs, [1, 1, 1, 1, 2])
    assert [o is not None and o.reward for o in outcomes] == [0.5, 0.5, 0.5, 0.5, False]
    notes = [json.loads(line) for line in (tmp_path / "notes.jsonl").read_text().splitlines()]
    # Each episode ran in a folder of its own under agent.workdir, removed after it, behind the container prefix.
    assert not any(alive(n["pid"]) for n in notes)
    assert len({n["cwd"] for n in notes}) == 5 and all(n["cwd"] == n["workdir"] for n in notes)
    assert all(Path(n["cwd"]).parent == tmp_path / "work" for n in notes)
    assert not any(Path(n["cwd"]).exists() for n in notes) and list((tmp_path / "work").iterdir()) == []
    assert {n["container"] for n in notes} == {"yes"}
    # The program over its memory limit failed its own episode, with the reason.
    [hog] = manager.fail_reasons()
    assert "MemoryError" in hog, hog
    assert len(manager.fail_reasons()) == 1
    # Both hosts had episodes: the programs' parents.
    assert {_host_of(n["ancestors"], (first, second)).pid for n in notes} == {first.pid, second.pid}

    # A host killed while it plays (with its programs, as when its node is lost): only its episode fails.
    async def lose_one() -> Any:
        hang = asyncio.ensure_future(play_all_async(programs, manager, 3))
        holder = await _wait_for_hang(tmp_path / "notes.jsonl", (first, second))
        for child in _children(holder.pid):
            os.killpg(child, signal.SIGKILL)
        holder.kill()
        return holder, await hang
    holder, lost = server.call(lose_one(), timeout=60)
    assert lost is None
    reasons = manager.fail_reasons()
    assert any(re.search(r"agent host vm-\d was lost during the episode", r) for r in reasons), reasons
    # The next episodes go to the host still up.
    again = play_all(server, manager, programs, [1, 1, 1])
    assert [o.reward for o in again] == [0.5, 0.5, 0.5]
    assert holder.wait(timeout=10) == -signal.SIGKILL

    async def close() -> None:
        await programs.close()
    server.call(close(), timeout=10)


async def play_all_async(programs: AgentPrograms, manager: TrajectoryManager, secret: int) -> Any:
    return await play_or_fail(
        lambda tell: programs.play(TASK, Problem(str(secret), secret), group=f"g{secret}", max_tokens=1,
                                   on_trajectory=tell),
        manager, task=TASK.name, group=f"g{secret}", timeout_s=None)


async def _wait_for_hang(notes: Path, hosts: tuple[subprocess.Popen[str], ...]) -> subprocess.Popen[str]:
    """The host whose program is playing the never-ending episode (its program's parent)."""
    for _ in range(200):
        for line in notes.read_text().splitlines():
            note = json.loads(line)
            if note["secret"] == 3:
                return _host_of(note["ancestors"], hosts)
        await asyncio.sleep(0.1)
    raise AssertionError("the never-ending episode did not start")


def _host_of(ancestors: list[int], hosts: tuple[subprocess.Popen[str], ...]) -> subprocess.Popen[str]:
    """The host among `hosts` that a program of these `ancestors` descends from (its launcher, and the
    namespace's, stand between them)."""
    return next(h for h in hosts if h.pid in ancestors)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _parent(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return found


def kill_agent_host(register: Path, notes_pid_file: Path) -> str:
    """Kill the agent host whose program wrote `notes_pid_file` (the hung episode), with its programs, as when
    its node is lost; returns its name."""
    hung = int(notes_pid_file.read_text().split()[0])
    records = {r["pid"]: r for r in (json.loads(p.read_text()) for p in register.glob("*.json"))}
    parent = hung
    while parent not in records:  # up from the program, past its launcher, to its host
        parent = _parent(parent)
    record = records[parent]
    programs, todo = [], _children(parent)
    while todo:
        programs.append(todo.pop())
        todo += _children(programs[-1])
    os.kill(parent, signal.SIGKILL)  # first: a host that outlived its programs would report their deaths
    for pid in programs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return str(record["name"])


HOSTS_ROLE = "  agents:     {tags: [cpu], nodes: 1, tasks_per_node: 2}\n"


def agent_hosts_recipe(tmp_path: Path, *, engine: str, timeout_s: int = 30, extra: str = "") -> Path:
    """`test_agent_run`'s recipe with an agents role of two hosts."""
    faults = tmp_path / "faults"
    faults.mkdir()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(python=sys.executable, agent=AGENT, faults=faults, model=engine,
                                    timeout_s=timeout_s) + HOSTS_ROLE + f"output_dir: {tmp_path / 'runs'}\n" + extra)
    return recipe


def run_losing_the_hung_host(tmp_path: Path, *command: str, timeout: float = 600) -> tuple[int, str, str]:
    """Run `command` (``sfhpc run`` or ``launch --wait`` of `agent_hosts_recipe`) and, once the hung episode
    is playing, kill the agent host that plays it (and its programs); returns the exit code, the output and
    the killed host's name."""
    faults = tmp_path / "faults"
    run = subprocess.Popen([sys.executable, "-m", "sfhpc", *command], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not (faults / "hang.pids").exists() or not (faults / "hang.pids").read_text().strip():
            assert run.poll() is None and time.monotonic() < deadline, "the run ended before its hung episode began"
            time.sleep(0.2)
        killed = kill_agent_host(next((tmp_path / "runs").glob("*/agent-hosts")), faults / "hang.pids")
        out, _ = run.communicate(timeout=timeout)
    finally:
        run.kill()
    return run.returncode, out, killed


def check_lost_host_run(run_dir: Path, killed: str) -> None:
    """The run trained its budget; the crash failed its episode, and the host's loss only the episodes it held
    (the crash's too, when it had not ended yet)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = list(store.trajectories())
    assert len([t for t in trajectories if t.status == "consumed"]) == 2 * 2 * 4
    failed = [t.fail_reason for t in trajectories if t.status == "failed"]
    crashed = [r for r in failed if "crashed on purpose" in r]
    lost = [r for r in failed if f"agent host {killed} was lost during the episode" in r]
    assert len(crashed) <= 1 and lost and len(crashed) + len(lost) == len(failed), failed
    assert all(r.endswith("was lost during the episode (its connection broke)") for r in lost), lost
    log = (run_dir / "logs" / f"agent-host-{killed}.log")
    assert log.exists()


@pytest.mark.mpi
def test_a_run_with_agent_hosts_survives_losing_one(tmp_path: Path) -> None:
    code, out, killed = run_losing_the_hung_host(tmp_path, "run", str(agent_hosts_recipe(tmp_path, engine=TEST_ENGINE)))
    assert code == 0, out[-4000:]
    run_dir = Path(re.search(r"run folder (\S+)", out).group(1))  # type: ignore[union-attr]
    assert "component 2: local x1 node(s), 2 task(s) [agents]" in out and "outside the MPI world" in out
    check_lost_host_run(run_dir, killed)
