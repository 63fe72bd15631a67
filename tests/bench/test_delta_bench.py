"""`sfhpc bench delta`: a model of a named shape trains under AdamW and publishes every version as a delta to a
receiving rank, which ends holding the publisher's bytes exactly; the report gives each version's bytes on the
wire against the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_sfhpc

pytestmark = pytest.mark.mpi


def test_the_bench_reports_each_versions_bytes_and_the_receiver_holds_them_exactly(tmp_path: Path) -> None:
    out = tmp_path / "delta.json"
    done = run_sfhpc("bench", "delta", "--shape", "tiny", "--vocab", "0", "--steps", "3", "--lr", "1e-4",
                     "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    versions = report["versions"]
    assert [v["version"] for v in versions] == [0, 1, 2, 3] and report["bit_identical"]
    assert versions[0]["wire_bytes"] == versions[0]["bytes"] == report["whole_bytes"] > 1e6  # the first: whole
    # At a learning rate this high most elements move; still no version is larger than the model (one where every
    # bucket would go whole goes as a whole version), and the changed buckets went in the smallest encoding (one at
    # least as a bitmap).
    assert all(0 < v["wire_bytes"] <= v["bytes"] for v in versions[1:])
    assert sum(v["encodings"][3] for v in versions[1:]) >= 1
    assert report["max_share"] <= 1 and "bit-identical" in done.stdout
