"""Rank program of the broadcast test: `mpiexec -n 3 python -m tests.weights.broadcast_ranks OUT_DIR TRANSPORT`
(`mpi` or `torch`: a torch.distributed group, gloo here).

Rank 0 publishes three versions of a mixed set of tensors in small buckets (the second staged and sent in
two calls, the third cast to bf16 on the way, a new layout) and then finishes. Ranks 1 and
2 receive (rank 1 reusing one buffer, rank 2 with a fresh buffer per bucket) and record, per version,
the version number, the names per bucket and a SHA-256 of every tensor's bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

BUCKET_BYTES = 4096


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    big = torch.randn(64, 48, generator=gen)  # 12 KiB: larger than a bucket, travels alone
    return [
        ("model.embed_tokens.weight", torch.randn(10, 16, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(7, generator=gen)),  # odd size: padding follows
        ("empty", torch.zeros(0, 3)),
        ("model.layers.0.mlp.down_proj.weight", big),
        ("transposed", torch.randn(5, 9, generator=gen).t()),  # not contiguous
        ("counts", torch.arange(13, dtype=torch.int64) * (version + 1)),
        ("lm_head.weight", torch.randn(16, 10, generator=gen).to(torch.float16)),
    ]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> int:
    from mpi4py import MPI

    from sfhpc.weights import WeightPublisher, WeightReceiver, connect

    out = Path(sys.argv[1])
    world = MPI.COMM_WORLD
    comm = world.Split(0, world.Get_rank())  # the weight-broadcast group
    transport = connect(comm, sys.argv[2], root=0)
    assert type(transport).__name__ == {"mpi": "MPITransport", "torch": "TorchTransport"}[sys.argv[2]]
    record: list[dict[str, object]] = []
    if transport.is_source:
        publisher = WeightPublisher(transport, bucket_bytes=BUCKET_BYTES)
        for version in (1, 2, 3):
            dtype = torch.bfloat16 if version == 3 else None
            named = weights(version)
            if version == 2:
                publisher.stage(iter(named))
                named = [(n, torch.zeros_like(t)) for n, t in named]  # staging holds its own copy
                stats = publisher.send(version)
                named = weights(version)
            else:
                stats = publisher.publish(iter(named), version, dtype=dtype)
            if dtype is not None:
                named = [(n, t.to(dtype)) for n, t in named]
            record.append({"version": version, "buckets": stats.buckets, "bytes": stats.bytes,
                           "manifest_sent": stats.manifest_sent, "messages": stats.messages,
                           "digests": {n: digest(t) for n, t in named},
                           "shapes": {n: list(t.shape) for n, t in named},
                           "dtypes": {n: str(t.dtype) for n, t in named}})
        publisher.finish()
    else:
        receiver = WeightReceiver(transport, reuse_buffers=comm.Get_rank() == 1)
        while (incoming := receiver.receive()) is not None:
            entry: dict[str, object] = {"version": incoming.version, "bucket_names": [], "digests": {},
                                        "shapes": {}, "dtypes": {}}
            for bucket in incoming:  # digest each bucket before the next one may overwrite its buffer
                entry["bucket_names"].append([n for n, _ in bucket])  # type: ignore[attr-defined]
                for name, t in bucket:
                    entry["digests"][name] = digest(t)  # type: ignore[index]
                    entry["shapes"][name] = list(t.shape)  # type: ignore[index]
                    entry["dtypes"][name] = str(t.dtype)  # type: ignore[index]
            record.append(entry)
    (out / f"rank{comm.Get_rank()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
