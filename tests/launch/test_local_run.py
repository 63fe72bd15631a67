"""`sfhpc probe --local` and `sfhpc run`: the same recipe on one machine, ranks started by Open MPI's mpiexec
(no Slurm)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import RECIPES, assert_one_line_error, run_sfhpc

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("recipe", "components", "roles"), [
    ("report.yaml", [0, 0, 1, 1], [["controller"], ["trainer"], ["rollout"], ["rollout"]]),
    ("report-colocated.yaml", [0, 0, 0], [["controller"], ["trainer", "rollout"], ["trainer", "rollout"]]),
])
def test_probe_locally_with_mpiexec(tmp_path: Path, recipe: str, components: list[int],
                                    roles: list[list[str]]) -> None:
    path = tmp_path / recipe
    path.write_text((RECIPES / recipe).read_text() + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("probe", str(path), "--local", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    assert [r["component"] for r in report["ranks"]] == components
    assert [r["roles"] for r in report["ranks"]] == roles
    assert {r["launcher"] for r in report["ranks"]} == {"mpiexec"}
    assert report["allgather_rank_component"] == [[i, c] for i, c in enumerate(components)]


def test_an_rl_run_needs_a_task(tmp_path: Path) -> None:
    """A recipe without a task is a probe's, never an RL run that quietly does something else."""
    path = tmp_path / "report.yaml"
    path.write_text((RECIPES / "report.yaml").read_text() + f"output_dir: {tmp_path / 'runs'}\n")
    for command in ("run", "launch"):
        assert_one_line_error(run_sfhpc(command, str(path)), f"{path}: task: required: the task the agents learn",
                              f"run `sfhpc probe {path}`")
    assert not (tmp_path / "runs").exists()


def test_verbose_gives_the_console_back_to_mpiexec_and_the_libraries(tmp_path: Path) -> None:
    """Without --verbose mpiexec is quiet (a failing rank's own line says it all) and the ranks keep the
    libraries' INFO lines in their logs; with it, both are as they were (sfhpc.runtime.rank_log)."""
    from sfhpc.config import load_recipe
    from sfhpc.launch.local import mpiexec_command
    from sfhpc.plan.local_map import local_cluster_map
    from sfhpc.plan.resolve import resolve

    recipe = load_recipe(RECIPES / "report.yaml")
    plan = resolve(recipe, local_cluster_map(recipe))
    quiet = mpiexec_command(plan, "r.yaml", None, tmp_path)
    verbose = mpiexec_command(plan, "r.yaml", None, tmp_path, verbose=True)
    assert "--quiet" in quiet and "--verbose" not in quiet
    assert "--quiet" not in verbose and verbose[-1] == "--verbose"  # an argument of the rank's command


def test_the_event_librarys_shutdown_warnings_leave_the_console_for_the_log(tmp_path: Path) -> None:
    """libevent's race at a job's abnormal end ("[warn] Epoll MOD(1) on fd 23 failed") goes to logs/mpiexec.log;
    every other line of mpiexec's stderr reaches the console as it came, in order."""
    import io

    from sfhpc.launch.local import LauncherNoise

    noise = (b"[warn] Epoll MOD(1) on fd 23 failed. Old events were 6; read change was 0 (none); write change was "
             b"2 (del); close change was 0 (none): Bad file descriptor\n")
    lines = [b"sfhpc: error: rank 0 (controller, node vm): a user error\n", noise,
             b"[warn] something else\n", "caf\xe9 \u2713\n".encode(), b"last line without a newline"]
    console = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    log = tmp_path / "logs" / "mpiexec.log"
    LauncherNoise(log).forward(io.BytesIO(b"".join(lines)), console)
    console.flush()
    assert console.buffer.getvalue() == b"".join(lines[:1] + lines[2:])  # type: ignore[attr-defined]
    assert log.read_bytes() == noise
