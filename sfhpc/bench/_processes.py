"""The rank processes of a run on this machine, found in /proc (for cutting a run with a signal).

Slurm signals every process of a step (``proctrack/linuxproc`` and ``cgroup`` both reach the tasks and
everything they started, vLLM's engine processes included), not mpiexec; a benchmark or test that plays
Slurm on one machine signals the same processes: the Python interpreters running ``-m sfhpc.rank``
with the run folder on their command line (`rank_pids`), and their descendants (`step_pids`).
"""

from __future__ import annotations

from pathlib import Path


def rank_pids(run_dir: Path) -> list[int]:
    """The rank processes of a local run (``sfhpc run``) writing into `run_dir`."""
    wanted = str(Path(run_dir).absolute()).encode()  # the ranks get the absolute path (--run-dir)
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        is_python = "python" in Path(argv[0].decode(errors="replace")).name
        if is_python and b"sfhpc.rank" in argv and wanted in argv:
            pids.append(int(entry.name))
    return sorted(pids)


def step_pids(run_dir: Path) -> list[int]:
    """The rank processes of a local run and every process they started (what Slurm signals in a step)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ')'
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], rank_pids(run_dir)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)
