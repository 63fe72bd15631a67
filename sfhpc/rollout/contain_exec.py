"""The first process of every agent program: it starts the program and ends every process the program left.

A rank or agent host runs ``python -I -S contain_exec.py SPEC -- ARGV...`` (`sfhpc.rollout.containment`
builds the line) instead of the program itself. This process

- becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant whose parent exits (a daemon that
  called ``setsid()``, a kernel started in a session of its own) is re-parented to it, not to init, so none
  leaves its sight;
- dies, and first ends all it started, when the rank or host that started it dies (``PR_SET_PDEATHSIG``);
- forks the program, which before its ``exec`` moves into the episode's cgroup (where there is one), sets
  its resource limits and asks to be killed when this process dies; the parent of the fork is a single-
  threaded process, so none of that needs ``preexec_fn`` in the rank's multi-threaded one;
- when the program exits, or this process gets SIGTERM (a timeout, a cancelled episode, the rank closing),
  kills every descendant (the cgroup at once where there is one, then each process it can still see, until
  none is left) and exits as the program did.

It reads the standard library only, so that it starts in milliseconds, and never imports sfhpc.
``SPEC`` is a JSON object: ``parent`` (the pid that started it), ``limits`` (``{"RLIMIT_AS": bytes, ...}``),
``nproc_extra`` (processes beyond what the user runs now, or null), ``cgroup`` (a folder, or null),
``unshare`` (the ``unshare`` line of a PID namespace, or empty: see `_in_namespace`) and, for a launcher
inside a namespace, ``status_fd`` (where the program's wait status goes).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1        # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36
KILL_ROUNDS_S = 5.0         # how long descendants are hunted before giving up (each round kills all it sees)
CPU_GRACE_S = 5             # CPU seconds between SIGXCPU and SIGKILL
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(Exception):
    """A stop signal arrived: end everything."""


def _raise_stop(signum: int, frame: object) -> None:
    raise Stop


def _prctl() -> ctypes._FuncPointer | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _user_tasks(uid: int) -> int:
    """The processes and threads `uid` runs now (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count


def _start_program(spec: dict, command: list[str], prctl: ctypes._FuncPointer | None) -> None:
    """In the forked child: join the cgroup, set limits, die with the launcher, then become the program."""
    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if spec.get("cgroup"):
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
        limits = dict(spec.get("limits") or {})
        if spec.get("nproc_extra") is not None and os.getuid() != 0:  # root is not bound by RLIMIT_NPROC
            limits["RLIMIT_NPROC"] = _user_tasks(os.getuid()) + int(spec["nproc_extra"])
        for name, value in limits.items():
            # CPU time: SIGXCPU at the limit (a program may catch it and end well), SIGKILL a little later.
            hard = int(value) + CPU_GRACE_S if name == "RLIMIT_CPU" else int(value)
            resource.setrlimit(getattr(resource, name), (int(value), hard))
        os.execvp(command[0], command)
    except OSError as exc:
        os.write(2, f"sfhpc: the agent program {command[0]!r} could not start: {exc.strerror or exc}\n".encode())
    os._exit(127)


def _descendants(root: int) -> list[int]:
    """The living (not zombie) processes below `root`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in (b"Z", b"X"):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def _reap() -> None:
    """Collect every child that has exited (orphans re-parented here included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_all(cgroup: str | None) -> None:
    """SIGKILL the cgroup (where there is one), then every descendant still seen, until none is left."""
    if cgroup:
        try:
            with open(os.path.join(cgroup, "cgroup.kill"), "w") as kill:
                kill.write("1")
        except OSError:  # a kernel before 5.14: each process it holds
            try:
                with open(os.path.join(cgroup, "cgroup.procs")) as procs:
                    for line in procs:
                        _kill(int(line))
            except OSError:
                pass
    deadline = time.monotonic() + KILL_ROUNDS_S
    while True:
        left = _descendants(os.getpid())
        for pid in left:
            _kill(pid)
        _reap()
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _exit_as(status: int) -> None:
    """End this process as the program ended: the same exit status, or the same signal."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _in_namespace(spec: dict, command: list[str]) -> tuple[dict, list[str], tuple[int, int]]:
    """This launcher's program and spec when the program runs in a PID namespace: ``unshare`` starting a
    second launcher, the namespace's init, which applies the limits, ends the namespace's processes and
    writes the program's wait status to a pipe (``unshare`` reports a signalled child's status wrongly in
    some releases), plus the pipe's ends."""
    read, write = os.pipe()
    os.set_inheritable(write, True)
    inner = {"parent": None, "limits": spec.get("limits"), "nproc_extra": spec.get("nproc_extra"), "cgroup": None,
             "status_fd": write}
    line = [*spec["unshare"], sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(inner), "--",
            *command]
    return {**spec, "limits": {}, "nproc_extra": None}, line, (read, write)


def _status_from(read: int, status: int) -> int:
    """The program's wait status as the namespace's launcher wrote it, else `status` (``unshare``'s)."""
    try:
        written = os.read(read, 64).decode().strip()
    except OSError:
        written = ""
    finally:
        os.close(read)
    return int(written) if written.lstrip("-").isdigit() else status


def _report(spec: dict, status: int) -> None:
    """Write the program's wait status where the outer launcher reads it (namespace mode)."""
    fd = spec.get("status_fd")
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(int(fd), str(status).encode())
            os.close(int(fd))


def main(argv: list[str]) -> None:
    spec, command = json.loads(argv[1]), argv[3:]
    cgroup = spec.get("cgroup")
    # The launcher inside a PID namespace is its init: when it exits the kernel ends every process of the
    # namespace. It must not hunt through /proc, which is the node's: its own pid there is not 1, and the
    # pids it reads cannot be signalled from inside.
    init = spec.get("status_fd") is not None
    status_pipe = None
    if spec.get("unshare"):
        spec, command, status_pipe = _in_namespace(spec, command)
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stop)
    prctl = _prctl()
    program = 0
    try:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            prctl(PR_SET_CHILD_SUBREAPER, 1)
        if spec["parent"] is not None and os.getppid() != spec["parent"]:  # the rank died before the line above
            raise Stop
        program = os.fork()
        if program == 0:
            _start_program(spec, command, prctl)
        if status_pipe is not None:  # the write end is the inner launcher's alone: EOF when it ends
            os.close(status_pipe[1])
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                status = 0
                break
            if pid == program:
                break
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    except Stop:
        for signum in STOP_SIGNALS:  # a second signal must not cut the hunt short
            signal.signal(signum, signal.SIG_IGN)
        if init:
            os._exit(128 + signal.SIGTERM)  # (init ignores its own signals) the kernel ends the rest
        kill_all(cgroup)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # ended as the stop asked: the starter sees SIGTERM
    if not init:
        kill_all(cgroup)
    if status_pipe is not None:
        status = _status_from(status_pipe[0], status)
    _report(spec, status)
    _exit_as(status)


if __name__ == "__main__":
    main(sys.argv)
