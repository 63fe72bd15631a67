"""Rank program of the delta-update test: `mpiexec -n 3 python -m tests.weights.delta_ranks OUT_DIR TRANSPORT`.

Rank 0 publishes five versions with ``delta=True`` in small buckets: a first whole one, one that changes a few
elements of one tensor, a fifth of another's and every element of a third (sparse, bitmap and full buckets, the
rest the same), one equal to the one before (nothing but the table travels), a new layout (whole again) and a
delta on it. Ranks 1 and 2 receive with ``delta=True`` and keep, per tensor, a SHA-256 of the bytes their
engine would hold: only changed buckets are handed over, so what they never got must still be right; at the end,
the copy they keep (`held_weights`, what a restarted engine loads) is the last version whole.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.weights.broadcast_ranks import digest

BUCKET_BYTES = 4096


def base() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(40, 16, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=gen),
        "model.layers.0.input_layernorm.weight": torch.randn(7, generator=gen),  # odd size: padding follows
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 48, generator=gen),  # larger than a bucket
        "model.layers.1.mlp.up_proj.weight": torch.randn(24, 40, generator=gen),
        "lm_head.weight": torch.randn(64, 40, generator=gen),  # alone in its bucket
    }


def changed(weights: dict[str, torch.Tensor], name: str, share: float, seed: int) -> None:
    """Move `share` of the elements of `weights[name]` by far more than one bf16 step."""
    gen = torch.Generator().manual_seed(seed)
    tensor = weights[name]
    mask = torch.rand(tensor.shape, generator=gen) < share
    tensor[mask] += 0.5


def versions() -> list[dict[str, torch.Tensor]]:
    first = base()
    second = {n: t.clone() for n, t in first.items()}
    changed(second, "model.layers.0.self_attn.q_proj.weight", 0.01, 1)  # sparse
    changed(second, "model.layers.0.mlp.down_proj.weight", 0.2, 2)  # bitmap
    changed(second, "lm_head.weight", 1.0, 3)  # full
    third = {n: t.clone() for n, t in second.items()}  # the same bytes
    fourth = {**third, "model.layers.2.mlp.up_proj.weight": torch.ones(8, 8)}  # a new layout
    fifth = {n: t.clone() for n, t in fourth.items()}
    changed(fifth, "model.embed_tokens.weight", 0.02, 4)
    return [first, second, third, fourth, fifth]


def main() -> int:
    from mpi4py import MPI

    from sfhpc.weights import WeightPublisher, WeightReceiver, connect

    out = Path(sys.argv[1])
    world = MPI.COMM_WORLD
    comm = world.Split(0, world.Get_rank())
    transport = connect(comm, sys.argv[2], root=0)
    record: list[dict[str, object]] = []
    if transport.is_source:
        publisher = WeightPublisher(transport, bucket_bytes=BUCKET_BYTES, delta=True)
        for version, weights in enumerate(versions(), start=1):
            stats = publisher.publish(iter(weights.items()), version, dtype=torch.bfloat16)
            record.append({"version": version, "bytes": stats.bytes, "wire_bytes": stats.wire_bytes,
                           "encodings": list(stats.encodings), "buckets": stats.buckets,
                           "digests": {n: digest(t.to(torch.bfloat16)) for n, t in weights.items()}})
        publisher.finish()
    else:
        receiver = WeightReceiver(transport, keep_copy=True)
        held: dict[str, str] = {}
        while (incoming := receiver.receive()) is not None:
            handed = 0
            for bucket in incoming:
                handed += 1
                held.update((name, digest(t)) for name, t in bucket)
            record.append({"version": incoming.version, "handed": handed, "digests": dict(held)})
        kept = receiver.held_weights()  # what a restarted engine would load: the last version, whole
        assert kept is not None
        record.append({"version": kept[0], "kept": {name: digest(t) for name, t in kept[1]}})
    (out / f"rank{comm.Get_rank()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
