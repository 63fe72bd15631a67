"""Agent programs on nodes of their own, inside an RL run on the dev cluster under `sfhpc launch` (real Slurm,
real MPI, real vLLM, real training): one heterogeneous job of three components, the controller and trainer on
a node of the ``train`` partition, the rollout rank with vLLM on a node of the ``rollout`` partition, one MPI
world across those two, and two agent hosts (an ``agents`` role) on a third node, started by a step of their
own outside that world. The programs call back over the network to the rollout rank with its token. One
episode crashes and one hangs; the host that plays the hung one is killed with its programs, as when its node
is lost, and the run still trains its whole budget: only that host's episodes failed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sfhpc.data.store import open_store
from tests.launch.test_slurm_jobs import het_completed, node_features, wait_for_sacct
from tests.rollout.test_agent_hosts import agent_hosts_recipe, check_lost_host_run, run_losing_the_hung_host
from tests.rollout.test_agent_run import VLLM

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]


def test_agent_programs_on_agent_hosts_play_inside_a_slurm_run(slurm_cluster: str, tmp_path: Path) -> None:
    recipe = agent_hosts_recipe(tmp_path, engine=VLLM, extra="launch: {time_minutes: 10}\n")
    code, out, killed = run_losing_the_hung_host(tmp_path, "launch", str(recipe), "--wait", "--timeout", "600")
    assert code == 0, out[-4000:]
    job_id = re.search(r"submitted job (\d+)", out).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"run folder (\S+)", out).group(1))  # type: ignore[union-attr]
    report = json.loads((run_dir / "launch_report.json").read_text())
    features = node_features(slurm_cluster)
    placed = [(r["roles"], r["component"], "train" in features[r["node"]], "rollout" in features[r["node"]])
              for r in report["ranks"]]
    assert placed == [(["controller"], 0, True, False), (["trainer"], 0, True, False), (["rollout"], 1, False, True)]
    # One MPI world across the first two components; the agent hosts are none of its ranks.
    assert report["allgather_rank_component"] == [[0, 0], [1, 0], [2, 1]]
    hosts = sorted(p.stem for p in (run_dir / "agent-hosts").glob("*.json"))
    nodes = {r["node"] for r in report["ranks"]}
    assert len(hosts) == 2 and len({h.rsplit("-", 1)[0] for h in hosts}) == 1 and killed in hosts
    assert hosts[0].rsplit("-", 1)[0] not in nodes  # a node of their own
    check_lost_host_run(run_dir, killed)
    with open_store(run_dir / "trajectories.h5") as store:  # the store the run folder holds
        engines = {s.engine for t in store.trajectories(status="consumed") for s in t.segments if s.generated}
    assert engines == {"vllm-r2"}  # every call of the programs went to the engine on the rollout node
    assert wait_for_sacct(job_id, het_completed(job_id, 3)) == het_completed(job_id, 3)
