"""The trajectory manager served to other ranks over real MPI (Open MPI's mpiexec, 3 ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.data.processes import ROOT

pytestmark = pytest.mark.mpi


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs Open MPI's mpiexec")
def test_manager_over_mpi_with_three_ranks(tmp_path):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = ["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "3", sys.executable, "-m",
               "tests.data.mpi_service_ranks", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    controller, *agents = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3))
    for rank, seen in enumerate(agents, start=1):
        assert seen["continuation-0"] == [[rank, 0, 0, 100, 100, 100, 100], 6]
        assert seen["continuation-1"] == [[rank, 1, 0, 101, 101, 101, 101], 6]
        assert seen["versions"] == [-1, -1, -1] + [1] * 4 + [2] * 6
        assert seen["status"] == "finished"
        # Errors cross the wire as the same classes, with the manager's message.
        assert seen["unknown"] == ["UnknownTrajectory", "no trajectory with id 'nobody'"]
        assert seen["finished"][0] == "TrajectoryFinished" and f"r{rank}-0" in seen["finished"][1]
        assert seen["invalid"][0] == "InvalidRequest"
        assert seen["one-way"] == "no error"
    assert agents[0]["batch"] == [0, ["r1-0", "r1-1", "r2-0", "r2-1"]]
    assert agents[0]["again"] is None  # nothing is handed out twice
    assert controller["by_status"]["consumed"] == 4
    assert controller["failed_one_way"] == 2  # each agent's add_generated on a finished trajectory
    # The first of them is kept for the controller to stop the run with (nobody waited for its answer).
    rank, method, message = controller["first_one_way"]
    assert rank in (1, 2) and method == "add_generated" and "finished" in message
    assert controller["heard_from"] == [1, 2]  # when each client rank was last heard from
    # Per agent rank: one failed episode, one failed and one finished episode of two agents.
    assert controller["by_status"]["failed"] == 2 * 3 and controller["by_status"]["finished"] == 2 * 2 + 2
    # Ended episodes are counted once each, whatever the number of their trajectories (7 per rank here):
    # a rank's running episodes are kept by that count. Rank 2's two routed episodes count for rank 1, the one
    # that ended there and the one that came home (it left rank 1's count then, and its end counted for rank 2).
    assert controller["episodes_ended"] == {"1": 5 + 2, "2": 5}
    assert sorted(map(tuple, controller["marks"])) == [(0, f"r{r}-{j}") for r in (1, 2) for j in (0, 1)]
    assert controller["generated_tokens"] == 4 * 10
    # Rank 2 idles a second before it says goodbye: the server polls with sleeps and does not burn a core.
    assert controller["wall_seconds"] > 1.0
    assert controller["cpu_seconds"] < 0.5 * controller["wall_seconds"], controller
