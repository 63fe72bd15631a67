"""Launch on the real dev cluster: one heterogeneous job, every rank where the plan says, one MPI world.

These tests submit real jobs to the 4-node Slurm cluster that `scripts/devcluster.sh` runs on this host
(slurmctld, slurmdbd + MariaDB, four slurmd), with Open MPI over `srun --mpi=pmix`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.launch.jobs import job_status
from sfhpc.launch.slurm_launch import submit
from sfhpc.plan.resolve import resolve
from sfhpc.rundir import new_run_dir
from tests.conftest import RECIPES, ROOT, assert_one_line_error, run_sfhpc
from tests.launch.run_watch import job_end_state, wait_until

pytestmark = pytest.mark.slurm


def node_features(slurm_cluster: str) -> dict[str, set[str]]:
    out = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %f"], capture_output=True, text=True, check=True).stdout
    return {name: set(features.split(",")) for name, features in (line.split() for line in out.splitlines())}


def recipe_in(tmp_path: Path, name: str) -> Path:
    """A copy of a shipped recipe whose runs go to tmp_path (the user's recipes stay untouched)."""
    text = (RECIPES / name).read_text() + f"output_dir: {tmp_path / 'runs'}\n"
    path = tmp_path / name
    path.write_text(text)
    return path


def check_report(report: dict, features: dict[str, set[str]], expected_components: list[tuple[str, int]]) -> None:
    """Every rank: the component, roles, tags and node the plan gives; the Allgather spans all components."""
    ranks = report["ranks"]
    assert report["world_size"] == sum(n for _, n in expected_components) == len(ranks)
    rank = 0
    for component, (feature, count) in enumerate(expected_components):
        for _ in range(count):
            r = ranks[rank]
            assert r["rank"] == rank and r["component"] == component, r
            assert feature in features[r["node"]], f"rank {rank} ran on {r['node']}, which lacks {feature}"
            rank += 1
    # The typed Allgather over the world communicator collected (rank, component) from every component.
    assert report["allgather_rank_component"] == [[r["rank"], r["component"]] for r in ranks]
    assert {c for _, c in report["allgather_rank_component"]} == set(range(len(expected_components)))
    assert "Open MPI" in report["mpi_library"]


def wait_for_sacct(job_id: str, expected: dict[str, str], timeout: float = 120) -> dict[str, str]:
    """Component states from sacct, polled until they equal `expected` (accounting lags behind the job)."""
    deadline = time.monotonic() + timeout
    while True:
        states = {c.job_id: c.state for c in job_status(job_id).components}
        if states == expected or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def het_completed(job_id: str, components: int) -> dict[str, str]:
    return {f"{job_id}+{k}": "COMPLETED" for k in range(components)}


def test_launch_disaggregated_recipe(slurm_cluster: str, tmp_path: Path) -> None:
    recipe_path = recipe_in(tmp_path, "report.yaml")
    done = run_sfhpc("probe", str(recipe_path), "--wait", "--timeout", "180")
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    check_report(report, node_features(slurm_cluster), [("train", 2), ("rollout", 2)])
    assert [r["roles"] for r in report["ranks"]] == [["controller"], ["trainer"], ["rollout"], ["rollout"]]
    assert all(r["job_id"] == job_id and r["launcher"] == "slurm" for r in report["ranks"])
    # Each rank wrote its own log, and the batch log holds every rank's output, labelled.
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == [f"rank-00{i}.log" for i in range(4)]
    # sacct: both het components completed (real accounting, not UNKNOWN).
    assert wait_for_sacct(job_id, het_completed(job_id, 2)) == het_completed(job_id, 2)
    status = run_sfhpc("status", job_id, "--output-dir", str(tmp_path / "runs"))
    assert status.returncode == 0 and f"job {job_id}: COMPLETED" in status.stdout
    assert "train" in status.stdout and "rollout" in status.stdout and str(run_dir) in status.stdout
    logs = run_sfhpc("logs", job_id, "--output-dir", str(tmp_path / "runs"))
    assert logs.returncode == 0 and "0: launch report:" in logs.stdout
    rank_log = run_sfhpc("logs", job_id, "--rank", "2", "--output-dir", str(tmp_path / "runs"))
    assert "roles rollout" in rank_log.stdout


def test_submitit_job_state_and_results_are_real(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = load_recipe(recipe_in(tmp_path, "report.yaml"))
    cluster = load_cluster_map(RECIPES / "cluster-dev.yaml")
    submission = submit(recipe, cluster, resolve(recipe, cluster), new_run_dir(recipe.output_dir, recipe.name),
                        probe=True)
    job = submission.job
    seen = {job.get_info(mode="force").get("State", "UNKNOWN")}
    results = job.results()  # waits; one result per rank, from both components
    assert [r["component"] for r in results] == [0, 0, 1, 1]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    # The ranks have written their results; the job ends once their processes have and accounting has heard
    # of it, which on a loaded host (the other test worker) took over 30 s once: bounded by what only a job
    # that never ends reaches, and the job's own view named if it does.
    try:
        wait_until("submitit to see the job completed",
                   lambda: job.get_info(mode="force").get("State") == "COMPLETED", timeout=180, poll_s=0.5)
    except AssertionError as timed_out:
        squeue = subprocess.run(["squeue", "-j", job.job_id, "-o", "%i %T %R"], capture_output=True, text=True)
        sacct = subprocess.run(["sacct", "-j", job.job_id, "-o", "JobID,State,ExitCode,End", "-P"],
                               capture_output=True, text=True)
        raise AssertionError(f"{timed_out}\n{squeue.stdout}{sacct.stdout}") from None
    assert seen <= {"PENDING", "RUNNING", "COMPLETED", "UNKNOWN"}  # UNKNOWN only before sacct has the job
    assert job.state == "COMPLETED"


def sbatch_template(template: str, recipe_path: Path, tmp_path: Path) -> tuple[int, str, str]:
    """`sbatch slurm_templates/TEMPLATE RECIPE --probe` as a user types it, followed to its end: (exit code,
    job id, batch log). The template passes its arguments on to every rank, so ``--probe`` makes it a launch
    report. Followed through sacct rather than with ``sbatch --wait``, which looks every 2 to 10 s."""
    env = dict(os.environ, SFHPC_PYTHON=sys.executable)
    out = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "slurm-%j.out"),
                          str(ROOT / "slurm_templates" / template), str(recipe_path), "--probe"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
    job_id = out.stdout.strip().split(";")[0]
    state = wait_until(f"job {job_id} to end", lambda: job_end_state(job_id), timeout=180)
    codes = [int(c.exit_code.split(":")[0]) for c in job_status(job_id).components]
    code = max(codes) or (0 if state == "COMPLETED" else 1)
    return code, job_id, (tmp_path / f"slurm-{job_id}.out").read_text()


def test_sbatch_template_gives_the_same_result(slurm_cluster: str, tmp_path: Path) -> None:
    code, job_id, log = sbatch_template("dev-disaggregated.sbatch", recipe_in(tmp_path, "report.yaml"), tmp_path)
    assert code == 0, log
    report = json.loads((tmp_path / "runs" / f"report-job{job_id}" / "launch_report.json").read_text())
    check_report(report, node_features(slurm_cluster), [("train", 2), ("rollout", 2)])
    assert [r["roles"] for r in report["ranks"]] == [["controller"], ["trainer"], ["rollout"], ["rollout"]]
    assert wait_for_sacct(job_id, het_completed(job_id, 2)) == het_completed(job_id, 2)


def test_colocated_recipe_gives_one_component(slurm_cluster: str, tmp_path: Path) -> None:
    code, job_id, log = sbatch_template("dev-colocated.sbatch", recipe_in(tmp_path, "report-colocated.yaml"),
                                        tmp_path)
    assert code == 0, log
    report = json.loads((tmp_path / "runs" / f"report-colocated-job{job_id}" / "launch_report.json").read_text())
    check_report(report, node_features(slurm_cluster), [("train", 3)])
    assert [r["roles"] for r in report["ranks"]] == [["controller"], ["trainer", "rollout"], ["trainer", "rollout"]]
    assert len({r["node"] for r in report["ranks"]}) == 2  # two train nodes
    assert wait_for_sacct(job_id, {job_id: "COMPLETED"}) == {job_id: "COMPLETED"}


def test_template_refuses_a_recipe_of_another_shape(slurm_cluster: str, tmp_path: Path) -> None:
    code, _, log = sbatch_template("dev-colocated.sbatch", recipe_in(tmp_path, "report.yaml"), tmp_path)
    assert code != 0
    assert "0: sfhpc: error: this job has 1 component(s) with tasks [3]" in log
    assert "sfhpc render RECIPE --template" in log and "Traceback" not in log


def test_tags_check_against_live_cluster(slurm_cluster: str, tmp_path: Path) -> None:
    good = run_sfhpc("tags", "check", str(RECIPES / "cluster-dev.yaml"))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "the map matches the live cluster" in good.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text((RECIPES / "cluster-dev.yaml").read_text()
                      .replace("constraint: l40s", "constraint: a100")
                      .replace("partition: train", "partition: training")
                      .replace("nodes: 2\n    tags: [rollout, reward, cpu]\n    cpus_per_node: 4",
                               "nodes: 3\n    tags: [rollout, reward, cpu]\n    cpus_per_node: 8"))
    bad = run_sfhpc("tags", "check", str(broken))
    assert bad.returncode == 1
    assert "pool 'h100': partition 'training' does not exist (partitions: rollout, train, urgent)" in bad.stdout
    assert ("pool 'l40s': no node of partition 'rollout' has feature 'a100' (features there: l40s, rollout)"
            in bad.stdout)
    wrong_count = tmp_path / "count.yaml"
    wrong_count.write_text((RECIPES / "cluster-dev.yaml").read_text().replace(
        "nodes: 2\n    tags: [rollout, reward, cpu]\n    cpus_per_node: 4",
        "nodes: 3\n    tags: [rollout, reward, cpu]\n    cpus_per_node: 8",
    ).replace("cluster: sfhpcdev", "cluster: other"))
    bad = run_sfhpc("tags", "check", str(wrong_count))
    assert bad.returncode == 1
    assert "cluster: the map says 'other', the live cluster is 'sfhpcdev'" in bad.stdout
    assert "pool 'l40s': the map says 3 node(s), rollout[l40s] has 2 (n3,n4)" in bad.stdout
    assert "pool 'l40s': cpus_per_node is 8 in the map, live nodes have CPUs n3=4, n4=4" in bad.stdout
    assert "3 mismatch(es)" in bad.stdout


def test_tags_check_names_each_site_problem_of_the_live_cluster(slurm_cluster: str, tmp_path: Path) -> None:
    """The site check against the live dev cluster: nothing as it is; a drained node, a partition that never
    preempts and one whose grace is shorter than the recipe's stopping time each give one line, then
    nothing again once they are put back."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((RECIPES / "report.yaml").read_text().replace("launch:\n", "launch:\n  signal_grace_s: 15\n"))
    check = ("tags", "check", str(RECIPES / "cluster-dev.yaml"), "--recipe", str(recipe))
    shipped = run_sfhpc(*check)
    assert shipped.returncode == 0 and "site:" not in shipped.stdout, shipped.stdout + shipped.stderr
    changes = (["nodename=n2", "state=drain", "reason=site check test"], ["partitionname=train", "PreemptMode=OFF"],
               ["partitionname=rollout", "GraceTime=0"])
    undo = (["nodename=n2", "state=resume"], ["partitionname=train", "PreemptMode=REQUEUE"],
            ["partitionname=rollout", "GraceTime=5"])
    try:
        for change in changes:
            subprocess.run(["scontrol", "update", *change], check=True, capture_output=True, timeout=30)
        changed = run_sfhpc(*check)
    finally:
        for change in undo:
            subprocess.run(["scontrol", "update", *change], check=True, capture_output=True, timeout=30)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    site = [line.removeprefix("site: ") for line in changed.stdout.splitlines() if line.startswith("site: ")]
    assert [line.split(":")[0] for line in site] == ["pool 'h100'", "partition 'train'", "partition 'rollout'"], site
    assert site[0].startswith("pool 'h100': n2 drained ('site check test'): not capacity, 1 of its 2 node(s)")
    assert "PreemptMode=OFF under preempt/partition_prio" in site[1]
    assert "GraceTime 0 s + KillWait 10 s = 10 s after TERM, less than the 15 s" in site[2]
    assert "3 site problem(s)" in changed.stdout and "the map matches the live cluster" in changed.stdout
    again = run_sfhpc(*check)
    assert again.returncode == 0 and "site:" not in again.stdout, again.stdout


def test_cancel_and_status_of_a_running_job(slurm_cluster: str, tmp_path: Path) -> None:
    out = subprocess.run(["sbatch", "--parsable", "-p", "rollout", "-o", "/dev/null", "--wrap", "sleep 120"],
                         capture_output=True, text=True, check=True)
    job_id = out.stdout.strip()
    assert run_sfhpc("cancel", job_id).returncode == 0
    wait_until(f"job {job_id} to be cancelled", lambda: job_status(job_id).state.split()[0] == "CANCELLED",
               timeout=120, poll_s=0.5)
    assert_one_line_error(run_sfhpc("status", "abc"), "'abc' is not a Slurm job id")
    assert_one_line_error(run_sfhpc("logs", job_id, "--output-dir", str(tmp_path)), f"job {job_id} is not in")


def test_missing_slurm_tools_give_one_line(tmp_path: Path) -> None:
    # A PATH with python but without sbatch/sacct: what a user on a login node without Slurm would see.
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{bare}:/usr/bin/no-such-dir"}
    for tool in ("sbatch", "sacct", "srun", "sinfo"):
        assert shutil.which(tool, path=env["PATH"]) is None
    done = subprocess.run([sys.executable, "-m", "sfhpc", "probe", str(RECIPES / "report.yaml"), "--cluster",
                           str(RECIPES / "cluster-dev.yaml")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert_one_line_error(done, "'sbatch' not found on PATH", "sfhpc run")
    assert not (tmp_path / "runs").exists()  # nothing written when the launch cannot happen
    done = subprocess.run([sys.executable, "-m", "sfhpc", "plan", str(RECIPES / "report.yaml")], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert_one_line_error(done, "no cluster map given", "--cluster MAP")
    done = subprocess.run([sys.executable, "-m", "sfhpc", "status", "12"], env=env, capture_output=True, text=True)
    assert_one_line_error(done, "'sacct' not found on PATH")
    done = subprocess.run([sys.executable, "-m", "sfhpc", "tags", "check", str(RECIPES / "cluster-dev.yaml")],
                          env=env, capture_output=True, text=True)
    assert_one_line_error(done, "'sinfo' not found on PATH")
