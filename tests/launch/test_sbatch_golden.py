"""The batch scripts are byte-for-byte what the golden files hold (and what slurm_templates/ ships).

After an intended change, regenerate with:  SFHPC_UPDATE_GOLDEN=1 .venv/bin/pytest tests/launch/test_sbatch_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.launch.sbatch import SbatchSpec, flag, render_sbatch
from sfhpc.launch.slurm_launch import launch_spec, template_text
from sfhpc.plan.resolve import resolve
from tests.conftest import ROOT

GOLDEN = Path(__file__).parent / "golden"
CASES = {  # name: (recipe, cluster map, shipped template)
    "dev-disaggregated": ("recipes/report.yaml", "recipes/cluster-dev.yaml"),
    "dev-colocated": ("recipes/report-colocated.yaml", "recipes/cluster-dev.yaml"),
    "dev-agent-hosts": ("recipes/guess-number-agent-hosts.yaml", "recipes/cluster-dev.yaml"),
    "h100-l40s": ("recipes/h100-l40s-grpo.yaml", "recipes/cluster-h100-l40s.yaml"),
}
UPDATE = os.environ.get("SFHPC_UPDATE_GOLDEN") == "1"
HOW = "regenerate with: SFHPC_UPDATE_GOLDEN=1 .venv/bin/pytest tests/launch/test_sbatch_golden.py"


def _check(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} is missing; {HOW}"
    assert path.read_text() == text, f"{path} differs from the rendered script; if the change is intended, {HOW}"


def _load(case: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    recipe_path, map_path = CASES[case]
    monkeypatch.chdir(ROOT)  # sources are recorded relative to the project folder, as a user types them
    recipe, cluster = load_recipe(recipe_path), load_cluster_map(map_path)
    return recipe, cluster, resolve(recipe, cluster)


@pytest.mark.parametrize("case", sorted(CASES))
def test_launch_script_matches_golden(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe, cluster, plan = _load(case, monkeypatch)
    spec = launch_spec(recipe, cluster, plan, Path("/runs/example"), "/usr/bin/python3 -u -m submitit.core._submit "
                       "/runs/example/submitit", python="/usr/bin/python3")
    _check(GOLDEN / f"{case}.launch.sbatch", render_sbatch(spec))


@pytest.mark.parametrize("case", sorted(CASES))
def test_shipped_template_is_current(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe, cluster, plan = _load(case, monkeypatch)
    _check(ROOT / "slurm_templates" / f"{case}.sbatch", template_text(recipe, cluster, plan))


def test_render_is_sorted_quoted_and_deterministic() -> None:
    spec = SbatchSpec(components=({"partition": "a b", "nodes": 2, "exclusive": True, "qos": None},
                                  {"partition": "c"}),
                      command="run", srun_flags={"mpi": "pmix"}, environment={"Z": "1", "A": "x y"})
    text = render_sbatch(spec)
    assert text == render_sbatch(spec)
    lines = text.splitlines()
    assert lines[1:5] == ["#SBATCH --exclusive", "#SBATCH --nodes=2", "#SBATCH --partition='a b'", "#SBATCH hetjob"]
    assert "export A='x y'" in lines and lines.index("export A='x y'") < lines.index("export Z=1")
    assert lines[-1] == "srun --het-group=0,1 --mpi=pmix run"
    assert flag("cpus_per_task", 3) == "--cpus-per-task=3" and flag("qos", None) is None


def test_attach_script_matches_golden(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sfhpc attach` on the H100/L40S map: requeueable, USR1 to every task ahead of the limit, a GPU per worker,
    after the run's job (a recipe's attach section), outside MPI."""
    from sfhpc.launch.attach import AttachRequest, attach_spec, pool_for

    recipe, cluster, _ = _load("h100-l40s", monkeypatch)
    request = AttachRequest(4, partition=None, qos="preempt", time_minutes=60, after="1234")
    spec = attach_spec(recipe, pool_for(recipe, cluster, None), request, "/runs/example", python="/usr/bin/python3",
                       output="/runs/example/logs/attach-%j.out")
    _check(GOLDEN / "h100-l40s.attach.sbatch", render_sbatch(spec))
