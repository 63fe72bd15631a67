"""Staged weight updates (``engine.staged_updates``) over real MPI, on a link paced like a 7B's broadcast
(`sfhpc.weights.paced.PacedLink`): the engine generates while a version comes in and pauses only to load it,
where a receiver that loads each version as it arrives is paused for the whole transfer; every token belongs to
the version that generated it, and the copy holds exactly what was sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_under_mpiexec

pytestmark = pytest.mark.mpi

LINK_S = 0.6  # seconds a whole version takes on the paced link


def test_a_staged_version_comes_in_while_the_engine_generates_and_pauses_it_only_to_load(tmp_path: Path) -> None:
    done = run_under_mpiexec(2, "tests.weights.staged_ranks", str(tmp_path), str(LINK_S))
    assert done.returncode == 0, done.stdout + done.stderr
    sent = json.loads((tmp_path / "rank0.json").read_text())
    got = json.loads((tmp_path / "rank1.json").read_text())
    tokens = got["tokens"]

    def tokens_between(start: float, end: float) -> list[int]:
        return [version for at, version in tokens if start <= at < end]

    for mode, versions in (("paused", [1, 2]), ("staged", [3, 4])):
        assert [u["version"] for u in got[mode]] == versions
        for update in got[mode]:
            version = str(update["version"])
            assert update["held"] == {version: sent[mode][version]}, mode  # bit-exact, bucket by bucket
            pause = update["resumed"] - update["paused"]
            coming_in = update["paused"] - update["started"]
            paused_tokens = tokens_between(update["paused"] + 0.02, update["resumed"])
            assert paused_tokens == [], (mode, paused_tokens)  # nothing is generated while paused
            if mode == "paused":  # the transfer is inside the pause
                assert pause >= 0.9 * LINK_S and coming_in < 0.1 * LINK_S, update
            else:  # the transfer is before it, the engine generating with the version it holds
                assert coming_in >= 0.9 * LINK_S and pause < 0.1 * LINK_S, update
                during = tokens_between(update["started"], update["paused"])
                assert len(during) > 20 and set(during) == {update["version"] - 1}, during
    # After each update the engine generates with the new version only.
    last = got["staged"][-1]
    assert set(tokens_between(last["resumed"] + 0.02, float("inf"))) <= {4}
