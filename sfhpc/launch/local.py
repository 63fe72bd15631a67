"""Run a recipe on one machine without Slurm: the same ranks, started by Open MPI's mpiexec, placed on the
map of this machine (`sfhpc.plan.local_map`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO

from sfhpc.config.overrides import Overrides, as_arguments
from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.plan.local_map import LOCAL_MAP_NAME
from sfhpc.rundir import RunPaths
from sfhpc.runtime.slurm_env import PLAN_SHOWN_VAR, TASKS_PER_COMPONENT_VAR


def mpiexec_command(plan: LaunchPlan, recipe_path: str, cluster_path: str | None, run_dir: Path,
                    probe: bool = False, verbose: bool = False, overrides: Overrides | None = None) -> list[str]:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SfhpcError("'mpiexec' not found on PATH: install Open MPI (apt-get install openmpi-bin) "
                         "or run `make setup`")
    # --bind-to none: Open MPI would pin each rank to one core, and vLLM's CPU engine then finds no
    # core to spare. --oversubscribe: a recipe may ask for more ranks than this machine has cores.
    # --quiet: a failing rank says what failed in one line (sfhpc.runtime.fault) and ends the job with
    # MPI_Abort; mpiexec's banners about it would only repeat that (`sfhpc run` itself names a rank killed by
    # a signal, which mpiexec then no longer does). mpiexec ends the other ranks with SIGTERM and, after
    # odls_base_sigkill_timeout seconds, SIGKILL: 0, since a rank takes SIGTERM for a stop request
    # (sfhpc.runtime.preemption) and would announce a checkpoint that never comes.
    command = [mpiexec, *([] if verbose else ["--quiet"]), "--oversubscribe", "--bind-to", "none",
               "--mca", "odls_base_sigkill_timeout", "0",
               "-n", str(plan.world_size), sys.executable, "-m", "sfhpc.rank", recipe_path,
               "--run-dir", str(run_dir), "--cluster", cluster_path or LOCAL_MAP_NAME]
    return (command + (["--probe"] if probe else []) + (["--verbose"] if verbose else [])
            + as_arguments(overrides or {}))


def run_local(plan: LaunchPlan, recipe_path: str, cluster_path: str | None, run_dir: Path,
              probe: bool = False, output: IO[str] | None = None, verbose: bool = False,
              plan_shown: bool = False, overrides: Overrides | None = None) -> int:
    """Start every rank with mpiexec and wait; returns mpiexec's exit code: a failed rank's own (its
    `MPI_Abort` code: 2 for a user error, 1 for a fault), or 128 + N for a rank ended by signal N. The
    ranks' output goes to this process's, or to `output` (a file) when given. `plan_shown`: the caller printed
    the plan already, so rank 0 does not. `overrides`: recipe keys over the file's, given to every rank."""
    env = dict(os.environ)
    env[TASKS_PER_COMPONENT_VAR] = ",".join(str(n) for n in plan.tasks_per_component)
    if plan_shown:
        env[PLAN_SHOWN_VAR] = "1"
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # On the console, mpiexec's stderr passes through a filter (`LauncherNoise`); into a file, as it is.
    filtered = output is None and not verbose
    stderr = subprocess.PIPE if filtered else None if output is None else subprocess.STDOUT
    hosts = [] if probe else start_agent_hosts(plan, recipe_path, run_dir, output, overrides)
    try:
        with subprocess.Popen(mpiexec_command(plan, recipe_path, cluster_path, run_dir, probe, verbose, overrides),
                              env=env, stdout=output, stderr=stderr) as process:
            try:
                if process.stderr is not None:
                    LauncherNoise(RunPaths(run_dir).logs / "mpiexec.log").forward(process.stderr, sys.stderr)
                return process.wait()
            except BaseException:  # as subprocess.call: an interrupted wait leaves no mpiexec behind
                process.kill()
                raise
    finally:
        stop_agent_hosts(hosts)


class LauncherNoise:
    """mpiexec's stderr on its way to the console, less the lines that say nothing to a user.

    Open MPI's event library (libevent, epoll) prints ``[warn] Epoll MOD(1) on fd 23 failed ... Bad file
    descriptor`` when a process of the job ends while a socket to it is being watched: a race in its shutdown,
    harmless (open-mpi/ompi#2004, #5520), seen after a rank's fault ended the job. On the console it would stand
    beside the fault's one line as a second, misleading one; such lines go to ``logs/mpiexec.log`` instead.
    Every other line passes through as it comes."""

    PATTERN = re.compile(rb"^\[warn\] Epoll [A-Z]+\(\d+\) on fd \d+ failed")

    def __init__(self, log: Path) -> None:
        self.log = log

    def forward(self, source: IO[bytes], console: IO[str]) -> None:
        """Copy `source` line by line until it ends (the process exits)."""
        target = console.buffer if hasattr(console, "buffer") else None
        for line in iter(source.readline, b""):
            if self.PATTERN.match(line):
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with self.log.open("ab") as kept:
                    kept.write(line)
                continue
            if target is not None:
                console.flush()
                target.write(line)
                target.flush()
            else:
                console.write(line.decode("utf-8", "replace"))
                console.flush()


def start_agent_hosts(plan: LaunchPlan, recipe_path: str, run_dir: Path, output: IO[str] | None,
                      overrides: Overrides | None = None) -> list[subprocess.Popen[bytes]]:
    """The agents role's hosts, as processes of this machine beside mpiexec's ranks (no ranks themselves)."""
    component = plan.agent_hosts
    if component is None:
        return []
    return [subprocess.Popen([sys.executable, "-m", "sfhpc.rank.agent_host", recipe_path, "--run-dir",
                              str(run_dir), "--index", str(index), "--bind", "127.0.0.1",
                              *as_arguments(overrides or {})],
                             stdout=output, stderr=None if output is None else subprocess.STDOUT)
            for index in range(component.num_tasks)]


def stop_agent_hosts(hosts: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    for host in hosts:
        if host.poll() is None:
            host.terminate()
    for host in hosts:
        try:
            host.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()
