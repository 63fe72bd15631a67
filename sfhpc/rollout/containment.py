"""Contained agent programs: every process an episode's program starts ends with the episode, and none sees
more of the run than it needs.

An agent program runs code the model wrote (tools, a sandbox, a kernel), so what it starts is not under
its author's control. Three ways keep all of it inside the episode, the first the node allows
(``agent.containment: auto``) or the one a recipe names:

- ``cgroup``: a cgroup v2 of its own per episode, where this process may make one (a delegated subtree, or
  root): at the end ``cgroup.kill`` takes every process in it, whatever it did to its session or parent;
- ``namespace``: a PID namespace (``unshare --pid --fork --kill-child``, in a user namespace when not root):
  the program is the namespace's init, and when it ends the kernel ends every process in the namespace;
- ``session``: none of those; the processes the program leaves are hunted by parentage.

In all three the program is started by `sfhpc.rollout.contain_exec`, a small launcher that is a child
subreaper (an orphaned descendant becomes its child, never init's), that kills every descendant when the
program exits or when it is told to stop, and that dies, after the same hunt, with the rank or agent host
that started it. It also sets the program's resource limits (address space, file size, CPU time, processes)
between its fork and the program's ``exec``, so the rank's multi-threaded process needs no ``preexec_fn``.

`program_environment` gives the program a minimal environment, never the rank's secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from sfhpc.errors import SfhpcError

log = logging.getLogger("sfhpc")

LAUNCHER = Path(__file__).with_name("contain_exec.py")
CGROUP_FS = Path("/sys/fs/cgroup")
STOP_GRACE_S = 5.0   # a told launcher ends its program's processes in milliseconds; after this it is killed
POLL_S = 0.05        # how often an exit is looked for (waiting on the process would wait on its pipes too)

Mode = Literal["cgroup", "namespace", "session"]
MODE_WORDS = {"cgroup": "a cgroup per episode", "namespace": "a PID namespace per episode (unshare)",
              "session": "the launcher's hunt of its descendants (no cgroup or PID namespace here)"}

# What every program gets of the starter's environment; `agent.env` adds names.
MINIMAL_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM",
               "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Names that pass only when `agent.env` names them exactly (never through a pattern such as ``WANDB_*``).
SECRET_PATTERNS = ("*_API_KEY", "*_KEY", "*_TOKEN", "*_SECRET", "*_SECRET_*", "*_PASSWORD", "*_CREDENTIALS",
                   "WANDB_*", "HF_*", "HUGGING_FACE_*", "MLFLOW_*", "AWS_*", "AZURE_*", "GOOGLE_*", "OPENAI_*",
                   "ANTHROPIC_*", "*PROXY*", "*_proxy")


def is_secret(name: str) -> bool:
    """Whether `name` may hold a credential (or a proxy that would carry the run's calls away)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in SECRET_PATTERNS)


def program_environment(named: Sequence[str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of `base` (the process's environment) an agent program sees: the minimal set and the
    names in `named` (``agent.env``; a trailing ``*`` names a prefix). A secret passes only when named
    exactly: a pattern never carries one."""
    base = os.environ if base is None else base
    exact = {name for name in named if not name.endswith("*")}
    patterns = [*MINIMAL_ENV, *(name for name in named if name.endswith("*"))]
    return {name: value for name, value in base.items()
            if name in exact or (not is_secret(name) and any(fnmatch.fnmatchcase(name, p) for p in patterns))}


@dataclasses.dataclass(frozen=True)
class ProgramLimits:
    """What each process of a program may take (None: no limit): address space and file size in MiB,
    CPU seconds, and processes beyond those its user runs when it starts (``RLIMIT_NPROC`` counts all of a
    user's processes and threads on the node, so the bound is what the program may add)."""

    memory_mb: int | None = None
    file_mb: int | None = None
    cpu_s: int | None = None
    processes: int | None = None

    def rlimits(self) -> dict[str, int]:
        limits = {"RLIMIT_AS": None if self.memory_mb is None else self.memory_mb << 20,
                  "RLIMIT_FSIZE": None if self.file_mb is None else self.file_mb << 20,
                  "RLIMIT_CPU": self.cpu_s, "RLIMIT_CORE": 0}
        return {name: value for name, value in limits.items() if value is not None}


NO_LIMITS = ProgramLimits()


@dataclasses.dataclass(frozen=True)
class Containment:
    """How this node contains agent programs (`choose`): the mode, the ``unshare`` line of ``namespace``,
    the cgroup under which ``cgroup`` makes one per episode."""

    mode: Mode
    unshare: tuple[str, ...] = ()
    cgroups: Path | None = None

    @staticmethod
    def choose(wanted: str = "auto") -> Containment:
        """The containment `wanted` (``auto``: the first this node allows); one line naming what is missing
        when a named one is not possible here."""
        return _choose(wanted)

    def command(self, argv: Sequence[str], limits: ProgramLimits, cgroup: Path | None) -> tuple[str, ...]:
        """The line that starts `argv` contained: the launcher, which (``namespace``) runs ``unshare`` and a
        second launcher inside the namespace."""
        spec = {"parent": os.getpid(), "limits": limits.rlimits(), "nproc_extra": limits.processes,
                "cgroup": str(cgroup) if cgroup is not None else None, "unshare": list(self.unshare)}
        # -I -S: the launcher imports the standard library alone, never a module planted in the working folder.
        return (sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec), "--", *argv)

    def new_cgroup(self) -> Path | None:
        """A cgroup for one episode (``cgroup`` mode), else None."""
        if self.cgroups is None:
            return None
        path = self.cgroups / f"sfhpc-episode-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        return path


@functools.cache
def _choose(wanted: str) -> Containment:
    if wanted in ("auto", "cgroup"):
        cgroups = _cgroup_parent()
        if cgroups is not None:
            return _chosen(Containment("cgroup", cgroups=cgroups), wanted)
        if wanted == "cgroup":
            raise SfhpcError(f"agent.containment: cgroup: this node has no cgroup v2 this process may add a cgroup "
                             f"under ({_own_cgroup() or 'none'}); ask for a delegated subtree, or use auto")
    if wanted in ("auto", "namespace"):
        unshare = _unshare_line()
        if unshare is not None:
            return _chosen(Containment("namespace", unshare=unshare), wanted)
        if wanted == "namespace":
            raise SfhpcError("agent.containment: namespace: 'unshare --pid --fork --kill-child' fails on this node "
                             "(no util-linux unshare, or user namespaces are off: "
                             "/proc/sys/user/max_user_namespaces); use auto")
    return _chosen(Containment("session"), wanted)


def _chosen(containment: Containment, wanted: str) -> Containment:
    log.info("agent programs are contained by %s%s", MODE_WORDS[containment.mode],
             " (agent.containment: auto)" if wanted == "auto" else "")
    return containment


def _own_cgroup() -> Path | None:
    """This process's cgroup v2 folder, or None (cgroup v1, or no cgroup file system)."""
    if not (CGROUP_FS / "cgroup.controllers").exists():
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    return None if path is None else CGROUP_FS / path.lstrip("/")


def _cgroup_parent() -> Path | None:
    """Where episodes' cgroups can go: this process's own cgroup, when it may make one there and move a
    process into it (a probe cgroup is made and removed)."""
    own = _own_cgroup()
    if own is None or not os.access(own / "cgroup.procs", os.W_OK):
        return None
    probe = own / f"sfhpc-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        return None
    try:
        return own if os.access(probe / "cgroup.procs", os.W_OK) else None
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def _unshare_line() -> tuple[str, ...] | None:
    """The ``unshare`` line that works here: a PID namespace (in a user namespace of its own unless root)
    whose init is the program, killed with its starter."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    pid = ("--pid", "--fork", "--kill-child")
    lines: list[tuple[str, ...]] = [(exe, *pid)] if os.geteuid() == 0 else []
    lines += [(exe, "--user", "--map-current-user", *pid), (exe, "--user", "--map-root-user", *pid)]
    for line in lines:
        try:
            if subprocess.run([*line, "--", "true"], capture_output=True, timeout=10).returncode == 0:
                return line
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def remove_cgroup(path: Path | None) -> None:
    """Remove an episode's cgroup (empty once its launcher has ended)."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.rmdir()


class ContainedProgram:
    """A program started through the launcher: `exited` waits for its end (not for its pipes), `stop` ends
    it and all it started."""

    def __init__(self, process: asyncio.subprocess.Process, cgroup: Path | None) -> None:
        self.process, self.cgroup = process, cgroup
        self._forced: asyncio.TimerHandle | None = None

    @classmethod
    async def start(cls, argv: Sequence[str], *, containment: Containment, limits: ProgramLimits,
                    env: Mapping[str, str], cwd: str | None, line_limit: int) -> ContainedProgram:
        cgroup = containment.new_cgroup()
        try:
            process = await asyncio.create_subprocess_exec(
                *containment.command(argv, limits, cgroup), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=dict(env), cwd=cwd,
                start_new_session=True, limit=line_limit)
        except BaseException:
            remove_cgroup(cgroup)
            raise
        return cls(process, cgroup)

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def exited(self, timeout_s: float | None = None) -> int | None:
        """The launcher's exit status once it has ended (after every process of the program), or None after
        `timeout_s`. ``Process.wait`` would also wait for every copy of its pipes to close."""
        async with asyncio.timeout(timeout_s) if timeout_s is not None else contextlib.nullcontext():
            with contextlib.suppress(TimeoutError):
                while self.process.returncode is None:
                    await asyncio.sleep(POLL_S)
        if self.process.returncode is not None:
            remove_cgroup(self.cgroup)
        return self.process.returncode

    def stop(self) -> None:
        """Tell the launcher to end the program and everything it started; kill it after STOP_GRACE_S."""
        if self.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        if self._forced is None:
            self._forced = asyncio.get_running_loop().call_later(STOP_GRACE_S, self._force)

    async def end(self) -> int | None:
        """`stop` and wait (bounded) until it has ended."""
        self.stop()
        return await self.exited(STOP_GRACE_S + 1)

    def _force(self) -> None:
        if self.process.returncode is None:  # the launcher did not end: its group and cgroup, at once
            log.warning("agent program launcher %d did not stop within %g s; killed", self.process.pid,
                        STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            if self.cgroup is not None:
                with contextlib.suppress(OSError):
                    (self.cgroup / "cgroup.kill").write_text("1")
