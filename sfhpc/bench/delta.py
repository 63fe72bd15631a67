"""Delta weight updates: the bytes each version takes on the wire when only what changed is sent, while a
model of a published shape trains.

    sfhpc bench delta [--shape qwen2.5-0.5b] [--vocab 32768] [--steps 20] [--lr 1e-6] [--rows 2] [--length 128]
                      [--transport mpi] [--out runs/bench/delta.json]

Two ranks under ``mpiexec``: rank 0 holds the model in float32 (random weights of the shape), takes AdamW
steps at `--lr` on a fixed random batch (next-token loss; what is measured is how many bf16 elements an
optimizer step moves, not what the model learns), and publishes each version in bf16 with
``WeightPublisher(delta=True)``, as the trainer does with ``engine.weight_delta``; rank 1 receives with
``delta=True`` and applies each version to its copy (every changed bucket checked against the publisher's
checksum). Per step: the bytes on the wire against the whole version, the buckets in each encoding and the
staging and sending seconds. After the last step the receiver's copy is compared with the publisher's staging
byte for byte. The first version is whole (the receiver holds nothing yet) and is reported apart.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sfhpc.bench import run_as_script
from sfhpc.bench.broadcast import relaunch_under_mpiexec, under_mpi
from sfhpc.errors import SfhpcError
from sfhpc.table import format_table


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sfhpc bench delta", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a model shape (sfhpc.model.shapes)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default 32768; 0: the shape's)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps, each published (default 20)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate (default 1e-6, an RL rate)")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=32.0)
    p.add_argument("--transport", choices=("mpi", "torch"), default="mpi")
    p.add_argument("--out", type=Path, default=Path("runs/bench/delta.json"), help="JSON result file")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps: at least 1")
    return args


def digest(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.contiguous().cpu().numpy().tobytes()).hexdigest()


def run_source(comm: Any, transport: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from sfhpc.model.shapes import shape
    from sfhpc.weights import WeightPublisher

    torch.manual_seed(0)
    config = shape(args.shape).config(vocab_size=args.vocab or None, max_seq_len=max(args.length, 128))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (args.rows, args.length), generator=gen)
    publisher = WeightPublisher(transport, int(args.bucket_mb * (1 << 20)), delta=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"bench delta: {args.shape} ({params / 1e9:.3f}B parameters, vocab {config.vocab_size}), "
          f"AdamW lr {args.lr:g}, {args.steps} steps", flush=True)
    rows = []
    for step in range(args.steps + 1):
        if step:  # version 0 is the initial weights; each later one follows one optimizer step
            started = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train_s = time.perf_counter() - started
        else:
            train_s = 0.0
        stats = publisher.publish(((n, p) for n, p in model.named_parameters()), step, dtype=torch.bfloat16)
        rows.append({"version": step, "bytes": stats.bytes, "wire_bytes": stats.wire_bytes,
                     "encodings": list(stats.encodings), "buckets": stats.buckets, "train_s": train_s,
                     "stage_s": stats.stage_seconds, "send_s": stats.send_seconds})
        print(f"  version {step:3d}: {stats.wire_bytes / 1e6:9.2f} MB of {stats.bytes / 1e6:.2f} MB "
              f"({stats.wire_bytes / stats.bytes:.2%})", flush=True)
    staging = publisher._staging
    assert staging is not None and staging.buffer is not None
    comm.send(digest(staging.buffer), dest=1)
    publisher.finish()
    return rows


def run_receiver(comm: Any, transport: Any) -> None:
    from sfhpc.weights import WeightReceiver

    receiver = WeightReceiver(transport, keep_copy=True)
    layout = None
    while (incoming := receiver.receive()) is not None:
        incoming.drain()  # applies each delta and checks each changed bucket's checksum
        layout = receiver._layout
    expected = comm.recv(source=0)
    held = layout.copy if layout is not None else None
    comm.send(held is not None and digest(held) == expected, dest=0)


def run_ranks(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from sfhpc.weights import connect

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SfhpcError("the delta bench runs as 2 ranks (one publisher, one receiver)")
    torch.set_num_threads(1)
    transport = connect(comm.Dup(), args.transport, root=0)
    if comm.Get_rank() == 1:
        run_receiver(comm, transport)
        return 0
    rows = run_source(comm, transport, args)
    identical = bool(comm.recv(source=1))
    later = rows[1:]
    shares = [r["wire_bytes"] / r["bytes"] for r in later]
    report = {"bench": "delta-weight-updates", "shape": args.shape, "vocab": args.vocab, "lr": args.lr,
              "steps": args.steps, "transport": args.transport, "bucket_bytes": int(args.bucket_mb * (1 << 20)),
              "whole_bytes": rows[0]["bytes"], "median_wire_bytes": statistics.median(r["wire_bytes"] for r in later),
              "max_wire_bytes": max(r["wire_bytes"] for r in later), "median_share": statistics.median(shares),
              "max_share": max(shares), "bit_identical": identical, "versions": rows}
    names = ("same", "full", "sparse", "bitmap")
    totals = [sum(r["encodings"][i] for r in later) for i in range(len(names))]
    print(format_table(["versions", "whole MB", "median MB", "max MB", "median share", "max share",
                        "buckets (same/full/sparse/bitmap)", "bit-identical"],
                       [[f"1-{args.steps}", f"{rows[0]['bytes'] / 1e6:.1f}",
                         f"{report['median_wire_bytes'] / 1e6:.2f}", f"{report['max_wire_bytes'] / 1e6:.2f}",
                         f"{report['median_share']:.2%}", f"{report['max_share']:.2%}", "/".join(map(str, totals)),
                         "yes" if identical else "NO"]]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if identical else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if under_mpi():
        return run_ranks(args)
    return relaunch_under_mpiexec("sfhpc.bench.delta", 2, argv)


if __name__ == "__main__":
    run_as_script(main)
