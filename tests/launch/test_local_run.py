"""`sfhpc run`: the same recipe on one machine, ranks started by Open MPI's mpiexec (no Slurm)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import RECIPES, run_sfhpc

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("recipe", "components", "roles"), [
    ("report.yaml", [0, 0, 1, 1], [["controller"], ["trainer"], ["rollout"], ["rollout"]]),
    ("report-colocated.yaml", [0, 0, 0], [["controller"], ["trainer", "rollout"], ["trainer", "rollout"]]),
])
def test_run_locally_with_mpiexec(tmp_path: Path, recipe: str, components: list[int], roles: list[list[str]]) -> None:
    path = tmp_path / recipe
    path.write_text((RECIPES / recipe).read_text() + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(path), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    assert [r["component"] for r in report["ranks"]] == components
    assert [r["roles"] for r in report["ranks"]] == roles
    assert {r["launcher"] for r in report["ranks"]} == {"mpiexec"}
    assert report["allgather_rank_component"] == [[i, c] for i, c in enumerate(components)]
