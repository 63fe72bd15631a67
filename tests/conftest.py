"""Shared fixtures: the project folder, the real dev Slurm cluster, and a CLI runner; the suite's tiers.

Tiers, by marker: ``slurm`` (jobs on the dev cluster), ``vllm`` (a real vLLM engine), ``mpi`` (ranks started
with mpiexec); everything else is the fast tier (`make test-fast`). `make test` runs every tier on two
pytest-xdist workers (``--dist loadgroup``): the Slurm tests in one group, since they share the cluster's four
nodes (a preemption takes them all), every other module a group of its own (module-scoped engines start
once); the Slurm group first, as the longest. (Every module that starts processes first, then the fast
tier, was measured slower: 2,013 s against 1,852 s, as two such modules at once slow each other more than
the fast tier slows them.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Two workers share two cores and most tests start several processes: each computes on one thread, unbound,
# and the Slurm jobs they submit inherit it. Left alone, torch starts a thread per core in every process and
# vLLM for CPUs pins its engine's threads to core 0; on a machine this loaded either makes each small operation
# wait for a time slice (a 300-step warm start took 9 minutes in the suite, 30 s alone).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
DEVCLUSTER = ROOT / "scripts" / "devcluster.sh"


# First: pytest-xdist turns the groups into test ids in its own hook of this name, which would otherwise run
# before this one and find no group: every test would go to any worker, two Slurm tests at once.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        slurm = item.get_closest_marker("slurm") is not None
        item.add_marker(pytest.mark.xdist_group("slurm" if slurm else item.nodeid.split("::", 1)[0]))
    # The Slurm tests first (one worker plays them in turn), then the files of whole runs (vLLM engines, MPI
    # worlds: a minute or more each), then the rest: xdist hands out the groups in this order (with
    # --no-loadscope-reorder, as `make test` runs it), so the last minutes hold many short files that fill both
    # workers, not one long run with the other worker idle.
    items.sort(key=lambda item: (item.get_closest_marker("slurm") is None, not _whole_run(item)))  # stable


def _whole_run(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in ("vllm", "mpi"))


@pytest.fixture(scope="session", autouse=True)
def model_build_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs of this session (and the Slurm jobs they submit, which inherit the environment) that would build
    the same tiny model copy it from one build (`sfhpc.model.build_cache`); every xdist worker shares it."""
    from sfhpc.model.build_cache import ENV

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "model-build-cache"
    os.environ[ENV] = str(folder)
    return folder


@pytest.fixture(scope="session")
def dev_cluster() -> str:
    """Start (or reuse) the real 4-node dev cluster; returns SLURM_CONF and exports it to the tests."""
    done = subprocess.run([str(DEVCLUSTER), "up"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"dev cluster did not come up:\n{done.stdout}\n{done.stderr}")
    conf = done.stdout.strip().splitlines()[-1].split("=", 1)[1]
    os.environ["SLURM_CONF"] = conf
    return conf


@pytest.fixture
def slurm_cluster(dev_cluster: str) -> str:
    """The dev cluster, every node in service. slurmd drains a node whose job step's processes outlive
    UnkillableStepTimeout after SIGKILL ("Kill task failed"); on a loaded 2-core machine a step of an
    earlier test can take that long to go, and every later test that needs the node would wait for it in
    vain. Such a node is put back in service before each test (no other drain is touched)."""
    listed = subprocess.run(["sinfo", "-R", "-h", "-o", "%n|%E"], capture_output=True, text=True, timeout=30)
    for line in listed.stdout.splitlines():
        node, _, reason = line.partition("|")
        if reason.strip() == "Kill task failed":
            subprocess.run(["scontrol", "update", f"nodename={node.strip()}", "state=resume"], capture_output=True,
                           timeout=30)
    return dev_cluster


def run_sfhpc(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the sfhpc command line as a user would, in `cwd`."""
    full_env = dict(os.environ)
    full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env.get('PATH', '')}"
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "sfhpc", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def run_under_mpiexec(ranks: int, module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m module args...` as `ranks` ranks of mpiexec on this machine, from the project folder."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    return subprocess.run(["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", str(ranks), sys.executable, "-m",
                           module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_recipe(tmp_path: Path, text: str, timeout: float = 900) -> tuple[Path, list[dict[str, Any]]]:
    """`sfhpc run` of a recipe's text (its runs under `tmp_path`), which must succeed; returns the run folder
    and its metrics rows."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text + f"output_dir: {tmp_path / 'runs'}\n")
    done = run_sfhpc("run", str(recipe), timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "reward curve" in done.stdout and "trajectory store:" in done.stdout
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_one_line_error(done: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """A user error: non-zero exit, one `sfhpc: error:` line on stderr, no traceback, all fragments in it."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sfhpc: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]
