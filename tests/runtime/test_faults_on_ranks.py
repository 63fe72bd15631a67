"""Every fault visible and fatal within seconds, on real ranks: `sfhpc run` (mpiexec, three ranks: the
controller, a trainer, a rollout rank with the deterministic test engine), a fault made on one rank
(`sfhpc.runtime.fault_injection`, or a taken port), and what a user sees: one ``sfhpc: error:`` line that
names the rank, the exit code (2: a user error, 1: a fault), every rank gone soon after the fault.

The time is measured from the fault itself (its line in the rank's log) to the end of `sfhpc run`, so a
slow start on a busy machine does not count against the bound.
"""

from __future__ import annotations

import datetime
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from sfhpc.rl.checkpoints import RunCheckpoints
from sfhpc.runtime.fault_injection import FAULTS_ENV
from sfhpc.runtime.liveness import INTERVAL_S
from sfhpc.runtime.step_marks import MARKS_ENV, read_marks
from tests.conftest import run_sfhpc

pytestmark = [pytest.mark.mpi]

FAULT_BOUND_S = 30.0  # from a rank's fault to every rank gone
HEARTBEAT_S = 8  # the recipe's budgets.heartbeat_timeout_s: small, with room for a busy machine's delays
RECIPE = """\
name: faulty
seed: 2
engine: {{name: test}}
model: {{build: {{layers: 1, hidden_size: 64, heads: 1}}}}
algorithm: {{group_size: 2}}
budgets: {{steps: {steps}, prompts_per_step: 2, heartbeat_timeout_s: {heartbeat}}}
task: {{name: next-letter}}
roles:
  controller: {{place_with: trainer}}
  trainer:    {{tags: [train], nodes: 1}}
  rollout:    {{tags: [rollout], nodes: 1}}
output_dir: {runs}
"""
NODE = r"node [^)]+"


def run(tmp_path: Path, faults: str | None = None, extra: str = "", steps: int = 3) -> tuple[int, str, Path, float]:
    """`sfhpc run` of the recipe (rank 0 builds its small model); returns its exit code, its stderr, the run
    folder and when it ended. The ranks leave step-guard marks in tmp_path/marks, as under the guard."""
    recipe = tmp_path / "faulty.yaml"
    recipe.write_text(RECIPE.format(heartbeat=HEARTBEAT_S, runs=tmp_path / "runs", steps=steps) + extra)
    (tmp_path / "marks").mkdir()
    env = {MARKS_ENV: str(tmp_path / "marks"), **({FAULTS_ENV: faults} if faults else {})}
    done = run_sfhpc("run", str(recipe), env=env, timeout=180)
    ended = time.time()
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    return done.returncode, done.stderr, run_dir, ended


def console_line(stderr: str) -> str:
    """The console's one line about the fault: nothing else on stderr (no traceback, no mpiexec banner)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("sfhpc: error: "), lines[0]
    return lines[0]


def logged_at(run_dir: Path, rank: int, pattern: str) -> float:
    """When the rank's log first says `pattern` (its lines begin with a local time)."""
    text = (run_dir / "logs" / f"rank-{rank:03d}.log").read_text()
    found = re.search(rf"^(\S+ \S+) rank {rank} \w+ {pattern}", text, re.MULTILINE)
    assert found, text
    return datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def assert_every_rank_gone(run_dir: Path) -> None:
    """No process of the run is left (a rank in MPI_Finalize, a stopped one): each had --run-dir RUN_DIR."""
    mine = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                mine.append(proc.name)
        except OSError:
            continue
    assert mine == [], f"processes of the run still there: {mine}"


def test_a_taken_agent_port_ends_the_run_with_the_rollout_ranks_line(tmp_path: Path) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text("#!/bin/sh\nexit 0\n")
    agent.chmod(0o755)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.time()
        code, stderr, run_dir, ended = run(tmp_path, extra=f"agent: {{command: [./agent.py], port: {port}}}\n")
    assert code == 2  # a user error: the job would not be requeued
    assert ended - started < 60
    line = console_line(stderr)
    assert re.fullmatch(rf"sfhpc: error: rank 2 \(rollout, {NODE}\): the agent endpoint cannot listen on "
                        rf"127\.0\.0\.1:{port}: .*address already in use; choose another port \(0 picks a free one\)",
                        line), line
    assert ended - logged_at(run_dir, 2, "fault on rank 2") < FAULT_BOUND_S
    assert "Traceback" in (run_dir / "logs" / "rank-002.log").read_text()  # the details are in the rank's log
    # Its mark says "user error" whatever srun's status: a step guard does not requeue a rerun that fails alike.
    assert read_marks(tmp_path / "marks") == {2: 2}
    assert_every_rank_gone(run_dir)


def test_a_crash_on_a_trainer_rank_ends_every_rank_with_the_fault_code(tmp_path: Path) -> None:
    code, stderr, run_dir, ended = run(tmp_path, faults="train=crash")
    assert code == 1  # a fault, not a user error: a step guard may requeue the job
    line = console_line(stderr)
    log = run_dir / "logs" / "rank-001.log"
    assert re.fullmatch(rf"sfhpc: error: rank 1 \(trainer, {NODE}\): RuntimeError: a fault injected at train "
                        rf"\({FAULTS_ENV}\) \(traceback in {re.escape(str(log))}\)", line), line
    assert ended - logged_at(run_dir, 1, "rank 1: crash injected at train") < FAULT_BOUND_S
    assert "Traceback" in log.read_text() and "in train" in log.read_text()
    assert read_marks(tmp_path / "marks") == {1: 1}  # left before the abort; the others were killed
    assert_every_rank_gone(run_dir)


def test_the_same_error_on_every_rank_is_one_line(tmp_path: Path) -> None:
    """A check every rank makes fails on every rank at once: rank 0 speaks for all of them."""
    code, stderr, run_dir, ended = run(tmp_path, faults="start=user-error")
    assert code == 2
    line = console_line(stderr)
    assert re.fullmatch(rf"sfhpc: error: rank 0 \(controller, {NODE}\): a user error injected at start "
                        rf"\({FAULTS_ENV}\)", line), line
    assert ended - logged_at(run_dir, 0, "rank 0: user-error injected at start") < FAULT_BOUND_S
    assert_every_rank_gone(run_dir)


def test_a_silent_rank_is_named_and_every_rank_ends(tmp_path: Path) -> None:
    """The rollout rank stops its own process (SIGSTOP) at its first episodes: no heartbeat, no answer. The
    controller names it once the recipe's heartbeat bound has passed, and the run ends as a fault."""
    code, stderr, run_dir, ended = run(tmp_path, faults="play=freeze@2")
    assert code == 1
    line = console_line(stderr)
    assert re.fullmatch(rf"sfhpc: error: rank 0 \(controller, {NODE}\): no heartbeat from rank 2 \(rollout, {NODE}\) "
                        rf"for \d+ s \(budgets\.heartbeat_timeout_s = {HEARTBEAT_S}\): the process is stopped, .*"
                        r"see logs/rank-002\.log in the run folder.*", line), line
    frozen = logged_at(run_dir, 2, "rank 2: freeze injected at play")
    # Silence counts from the last beat the controller took, which may be up to two beat intervals (one
    # sent before the freeze, one before the controller's watch took it) earlier than the freeze itself.
    assert HEARTBEAT_S - 2 * INTERVAL_S <= ended - frozen < HEARTBEAT_S + FAULT_BOUND_S / 2
    assert_every_rank_gone(run_dir)  # the stopped process too


def test_a_silent_controller_is_named_by_the_first_other_rank(tmp_path: Path) -> None:
    """The controller stops as the run begins: the first other rank names it (the others only later, should
    that one be gone too), and every rank ends, the stopped controller too."""
    code, stderr, run_dir, ended = run(tmp_path, faults="start=freeze@0")
    assert code == 1
    line = console_line(stderr)
    assert re.fullmatch(rf"sfhpc: error: rank 1 \(trainer, {NODE}\): no heartbeat from rank 0 \(controller, {NODE}\) "
                        rf"for \d+ s \(budgets\.heartbeat_timeout_s = {HEARTBEAT_S}\): .*", line), line
    frozen = logged_at(run_dir, 0, "rank 0: freeze injected at start")
    assert HEARTBEAT_S <= ended - frozen < HEARTBEAT_S + FAULT_BOUND_S / 2
    assert_every_rank_gone(run_dir)


def test_a_rank_killed_without_a_word_is_still_one_line(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer's way): the rank says nothing; `sfhpc run` says what mpiexec saw, 128 + 9."""
    code, stderr, run_dir, ended = run(tmp_path, faults="play=kill@2")
    assert code == 128 + 9
    line = console_line(stderr)
    assert line == (f"sfhpc: error: a rank of the run was ended by signal 9 (SIGKILL): killed, out of memory? its "
                    f"log is in {run_dir / 'logs'}; `sfhpc run --verbose` has mpiexec name the rank"), line
    assert ended - logged_at(run_dir, 2, "rank 2: kill injected at play") < FAULT_BOUND_S
    assert_every_rank_gone(run_dir)


DISK_BYTES = 6 << 20  # the model, a few checkpoints, then no space


def test_a_full_disk_stops_the_run_with_one_line_keeping_the_store_and_the_newest_checkpoint(tmp_path: Path) -> None:
    """The run folder on a small tmpfs, a checkpoint every step: the disk fills while the run writes (a
    checkpoint, the store, a log), and the run stops with one line naming it, its store readable with what it
    had flushed, and its newest complete checkpoint sound (a resume would start there)."""
    disk = tmp_path / "runs"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small file system cannot be mounted here: {mounted.stderr.strip()}")
    try:
        code, stderr, run_dir, _ = run(tmp_path, extra="training: {checkpoint_every: 1}\n", steps=500)
        assert code == 2, stderr  # a user error: a requeued job would find the disk as full
        line = console_line(stderr)
        assert re.fullmatch(rf"sfhpc: error: rank \d \(\w+(,\w+)*, {NODE}\): .*No space left on device.*", line), line
        checkpoint = RunCheckpoints(run_dir).latest()  # checksums verified
        assert checkpoint is not None and checkpoint.step >= 1
        with open_store(run_dir / "trajectories.h5") as store:
            trained = [t for t in store.trajectories() if t.status == "consumed"]
        assert len(trained) >= checkpoint.step * 2 * 2  # every step's groups, up to the checkpoint's
        assert_every_rank_gone(run_dir)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
