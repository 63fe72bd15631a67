"""Delta weight updates (`sfhpc.weights.delta`, ``WeightPublisher(delta=True)``): each encoding round-trips bit
for bit and is chosen where it is smallest; over each transport, three ranks end every version holding the
publisher's exact bytes although only the buckets that changed were sent and handed over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sfhpc.weights import delta
from tests.conftest import run_under_mpiexec

WORDS = 4096


def pair(share: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = torch.randint(-30000, 30000, (WORDS,), dtype=torch.int16, generator=gen)
    new = old.clone()
    mask = torch.rand(WORDS, generator=gen) < share
    new[mask] += 1
    return old, new


@pytest.mark.parametrize(("share", "encoding"), [(0.0, "same"), (0.01, "sparse"), (0.1, "sparse"), (0.2, "bitmap"),
                                                 (0.93, "bitmap"), (0.99, "full")])
def test_each_encoding_round_trips_and_is_the_smallest(share: float, encoding: str) -> None:
    # sparse while about one word in eight or fewer changed, bitmap up to about 94%, full beyond
    old, new = pair(share)
    mask = new != old
    code, payload = delta.encode(mask, new)
    assert delta.ENCODINGS[code] == encoding
    sizes = delta.sizes(mask)
    assert sizes[code] == min(sizes.values())
    if code in (delta.SPARSE, delta.BITMAP):
        assert payload.numel() == sizes[code] < 2 * WORDS
    held = old.clone()
    delta.apply(held, code, new.view(torch.uint8) if code == delta.FULL else payload)
    assert torch.equal(held, new)
    assert delta.checksum(held.view(torch.uint8)) == delta.checksum(new.view(torch.uint8))


def test_sparse_positions_far_apart_take_several_bytes_each_and_come_back() -> None:
    words = 1 << 23  # gaps of one to four LEB128 bytes
    positions = torch.tensor([0, 1, 200, 20_000, 3_000_000, words - 1])
    old = torch.zeros(words, dtype=torch.int16)
    new = old.clone()
    new[positions] = torch.arange(1, 7, dtype=torch.int16)
    code, payload = delta.encode(new != old, new)
    assert delta.ENCODINGS[code] == "sparse"
    # the counts; the gaps (0, 0, 198, 19_799, 2_979_999, 5_388_606) in 1, 1, 2, 3, 4 and 4 bytes and one byte
    # of padding; the values
    assert payload.numel() == 8 + (1 + 1 + 2 + 3 + 4 + 4) + 1 + 2 * 6
    delta.apply(old, code, payload)
    assert torch.equal(old, new)


def test_the_checksum_sees_a_changed_word_and_a_word_in_the_wrong_place() -> None:
    _, new = pair(0.0)
    reference = delta.checksum(new.view(torch.uint8))
    one_bit = new.clone()
    one_bit[100] ^= 1
    swapped = new.clone()
    swapped[[8, 12]] = swapped[[12, 8]]  # two 8-byte words exchanged: the same sum, another order
    assert delta.checksum(one_bit.view(torch.uint8)) != reference
    assert delta.checksum(swapped.view(torch.uint8)) != reference


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["mpi", "torch"])
def test_receivers_hold_every_version_exactly_from_deltas(tmp_path: Path, transport: str) -> None:
    done = run_under_mpiexec(3, "tests.weights.delta_ranks", str(tmp_path), transport)
    assert done.returncode == 0, done.stdout + done.stderr
    sent = json.loads((tmp_path / "rank0.json").read_text())
    encodings = [dict(zip(delta.ENCODINGS, v["encodings"])) for v in sent]
    # Whole: the first version and the new layout. The second: one bucket in each encoding.
    assert [v["wire_bytes"] == v["bytes"] for v in sent] == [True, False, False, True, False]
    assert encodings[1] == {"same": 1, "full": 1, "sparse": 1, "bitmap": 1}, encodings
    assert encodings[2] == {"same": sent[2]["buckets"], "full": 0, "sparse": 0, "bitmap": 0}
    assert sent[1]["wire_bytes"] < 0.5 * sent[1]["bytes"] and sent[2]["wire_bytes"] < 100
    assert sent[4]["wire_bytes"] < 0.02 * sent[4]["bytes"]
    for rank in (1, 2):
        *got, kept = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [v["version"] for v in got] == [1, 2, 3, 4, 5]
        assert kept["version"] == 5 and kept["kept"] == sent[-1]["digests"]  # the copy a restart would load
        # Handed to the engine: every bucket of a whole version, only the changed ones of a delta.
        changed = [sent[i]["buckets"] - encodings[i]["same"] if encodings[i] else sent[i]["buckets"]
                   for i in range(5)]
        assert [v["handed"] for v in got] == changed == [4, 3, 0, 5, 1]
        for s, g in zip(sent, got):
            assert g["digests"] == s["digests"], f"rank {rank} version {s['version']}"
