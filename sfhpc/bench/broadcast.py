"""Weight-broadcast bandwidth: the publisher over each transport against a raw ``MPI_Bcast`` of the same
bytes, in one run.

    python -m sfhpc.bench.broadcast [--ranks 3] [--repeats 9] [--bucket-mb 32] [--synthetic-mb 200]
                                    [--transports mpi,torch]

Rank 0 publishes, every other rank receives (as the engines would), over each transport in turn: ``mpi``
(host memory, ``MPI_Ibcast``) and ``torch`` (a `torch.distributed` group: gloo on CPUs, NCCL where CUDA is;
here the receiving ranks join it themselves, as ranks whose engine cannot). Two weight sets, both held as
float32 master weights and published in bf16, as the trainer does: the project's tiny Llama, and a
synthetic set of Llama-shaped tensors of about ``--synthetic-mb`` on the wire. Three methods alternate
in each repetition, every one timed from a common barrier to the last rank done:

* raw: one ``Bcast`` of an already-packed buffer of the same bytes (the floor);
* send: the broadcast itself: header + every bucket, received into the receivers' bucket buffers and
  handed out as ``(name, tensor)`` views; what was published is staged before the barrier;
* publish: stage (cast float32 -> bf16 into the staging buffer) and send, as one call; receivers poll
  for the header with short sleeps, as rollout ranks do between generation steps.

Send against raw is the broadcast's efficiency (what engines wait for: they keep generating while the
trainer stages). Publish against raw shows what the cast adds on the trainer. Medians are reported.
The first publish of a layout also sends the manifest and allocates the persistent buffers; it is
timed apart and left out. After the timings, receivers check one version bit for bit against the
weights they regenerate from the same seed. Absolute figures depend on the machine and its load; the
ratios, measured in one run, are what this measures.

Without an MPI launcher around it, the command starts itself under ``mpiexec -n RANKS``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from sfhpc.bench import run_as_script
from sfhpc.errors import SfhpcError
from sfhpc.table import format_table

CHILD_VAR = "SFHPC_BENCH_UNDER_MPI"
POLL_SECONDS = 0.0005  # receivers' header polling during "publish"
SMALL_SET_BYTES = 64 << 20


def _under_mpi() -> bool:
    from sfhpc.runtime.slurm_env import in_multi_task_step

    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")) or in_multi_task_step()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sfhpc.bench.broadcast", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=3, help="ranks to start when not under MPI (1 source + receivers)")
    p.add_argument("--repeats", type=int, default=9, help="timed repetitions of each method (median reported)")
    p.add_argument("--small-repeats", type=int, default=41,
                   help="repetitions for sets under 64 MB (quick, and noisier per repetition)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=32.0)
    p.add_argument("--synthetic-mb", type=float, default=200.0, help="size of the synthetic set (0: skip it)")
    p.add_argument("--transports", default="mpi,torch", help="comma-separated: mpi, torch")
    p.add_argument("--out", type=Path, default=Path("runs/bench/broadcast.json"), help="JSON result file")
    args = p.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(args.transports) - {"mpi", "torch"})
    if unknown or not args.transports:
        p.error(f"--transports: name mpi, torch or both (found {args.transports})")
    return args


def tiny_weights() -> list[tuple[str, torch.Tensor]]:
    """The project's default tiny Llama (sfhpc.model.tiny's configuration), seed 0, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sfhpc.config.recipe import ModelSpec
    from sfhpc.model.tiny import llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**llama_config(ModelSpec())))
    return [(n, p.detach()) for n, p in model.named_parameters()]


def synthetic_weights(megabytes: float, hidden: int = 1024, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Llama-shaped float32 tensors (hidden 1024, SwiGLU 2816, vocab 8192) of about `megabytes` in bf16."""
    inter, vocab = 2816, 8192
    gen = torch.Generator().manual_seed(seed)
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((megabytes * 1e6 - 2 * 2 * vocab * hidden) / layer_bytes))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    named = [("model.embed_tokens.weight", rand(vocab, hidden))]
    for i in range(layers):
        pre = f"model.layers.{i}."
        named += [(pre + f"self_attn.{p}_proj.weight", rand(hidden, hidden)) for p in "qkvo"]
        named += [(pre + "mlp.gate_proj.weight", rand(inter, hidden)),
                  (pre + "mlp.up_proj.weight", rand(inter, hidden)),
                  (pre + "mlp.down_proj.weight", rand(hidden, inter)),
                  (pre + "input_layernorm.weight", rand(hidden)),
                  (pre + "post_attention_layernorm.weight", rand(hidden))]
    named += [("model.norm.weight", rand(hidden)), ("lm_head.weight", rand(vocab, hidden))]
    return named


def _timed(comm: Any, fn: Any) -> float:
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t0
    return float(comm.allreduce(elapsed, op=MPI.MAX))  # the broadcast is done when the last rank has it


def bench_set(comm: Any, name: str, make: Any, args: argparse.Namespace, transport_name: str) -> dict[str, Any]:
    import numpy as np

    from sfhpc.weights import IncomingWeights, WeightPublisher, WeightReceiver, connect
    from sfhpc.weights.manifest import plan_buckets
    from sfhpc.weights.transport import TransportChoice

    wire = torch.bfloat16
    # Its own communicator: barriers and raw Bcasts use `comm`.
    transport = connect(comm.Dup(), cast(TransportChoice, transport_name), root=0)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    source = transport.is_source
    named = make() if source else None  # the receivers only learn the layout from the manifest
    # Every rank needs the total size for the raw buffer; the source knows it from the plan.
    total = comm.bcast(plan_buckets(named, 0, bucket_bytes, dtype=wire).total_bytes if named is not None else None,
                       root=0)
    repeats = args.small_repeats if total < SMALL_SET_BYTES else args.repeats
    raw = np.empty(total, dtype=np.uint8)
    raw.fill(7 if source else 0)  # touched before timing, like the publisher's persistent buffers
    publisher = WeightPublisher(transport, bucket_bytes) if source else None
    receiver = None if source else WeightReceiver(transport)
    published: list[Any] = []  # PublishStats of every "publish" (the source's stage time is read from them)

    def next_version() -> IncomingWeights:
        # A receiving rank, before the source's finish: a version always comes.
        assert receiver is not None
        incoming = receiver.receive()
        assert incoming is not None
        return incoming

    def do_raw() -> None:
        comm.Bcast(raw, root=0)

    def do_send(version: int) -> None:
        if publisher is not None:
            publisher.send(version)
        else:
            next_version().drain()  # every bucket received into (name, tensor) views

    def do_publish(version: int) -> None:
        if publisher is not None:
            assert named is not None  # the source's
            published.append(publisher.publish(named, version, dtype=wire))
            return
        # Receivers poll for the header with sleeps in between, as rollout ranks do while they generate,
        # rather than spinning in MPI and taking the core the source casts on.
        assert receiver is not None
        pending = receiver.start()
        while not pending.ready():
            time.sleep(POLL_SECONDS)
        incoming = pending.result()
        assert incoming is not None  # the source has not finished
        incoming.drain()

    # The first publish sends the manifest and builds the persistent buffers: timed on its own.
    first = _timed(comm, lambda: do_publish(0))
    times: dict[str, list[float]] = {"raw": [], "send": [], "publish": []}
    version = 0
    for rep in range(args.warmup + repeats):
        # Rotate the order, so no method always runs on a warmer (or busier) machine.
        methods = ("raw", "send", "publish")
        for which in methods[rep % 3:] + methods[:rep % 3]:
            version += 1
            if which == "raw":
                t = _timed(comm, do_raw)
            elif which == "send":
                if publisher is not None and named is not None:
                    publisher.stage(named, dtype=wire)  # before the barrier: engines are not waiting yet
                t = _timed(comm, lambda v=version: do_send(v))
            else:
                t = _timed(comm, lambda v=version: do_publish(v))
            if rep >= args.warmup:
                times[which].append(t)
    timed_publish = published[1 + args.warmup:]

    # Correctness, outside the timings: receivers compare one version with the weights regenerated here.
    ok = True
    if publisher is not None and named is not None:
        publisher.publish(named, 10_000, dtype=wire)
    else:
        expected = {n: t.to(wire) for n, t in make()}
        incoming = next_version()
        names = []
        for bucket in incoming:  # a bucket's views are valid until the next one is requested: check each now
            names += [n for n, _ in bucket]
            ok = ok and all(torch.equal(t.view(torch.int16), expected[n].view(torch.int16)) for n, t in bucket)
        ok = ok and incoming.version == 10_000 and names == list(expected)
    if publisher is not None:
        publisher.finish()
    elif receiver is not None:
        ok = ok and receiver.receive() is None
    verified = all(comm.allgather(ok))
    raw_s, send_s, pub_s = (statistics.median(times[k]) for k in ("raw", "send", "publish"))
    stage_s = statistics.median(s.stage_seconds for s in timed_publish) if source else None
    last = timed_publish[0] if source else None
    return {"set": name, "transport": transport_name, "tensors": len(named) if named is not None else None,
            "bytes": total, "repeats": repeats,
            "messages": last.messages if last else None, "buckets": last.buckets if last else None,
            "raw_median_s": raw_s, "send_median_s": send_s, "publish_median_s": pub_s,
            "stage_median_s": stage_s, "first_publish_s": first,
            "raw_GBps": total / raw_s / 1e9, "send_GBps": total / send_s / 1e9,
            "send_ratio": raw_s / send_s, "publish_ratio": raw_s / pub_s,
            "times_s": times, "verified": verified}


def run_ranks(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        raise SfhpcError("the broadcast bench needs at least 2 ranks (one source, one receiver): use --ranks 3")
    torch.set_num_threads(1)
    sets = [("tiny-llama", tiny_weights)]
    if args.synthetic_mb > 0:
        sets.append((f"synthetic-{args.synthetic_mb:g}MB", lambda: synthetic_weights(args.synthetic_mb)))
    results = [bench_set(comm, name, make, args, transport) for name, make in sets for transport in args.transports]
    if comm.Get_rank() != 0:
        return 0
    report = {"bench": "weight-broadcast", "ranks": comm.Get_size(), "receivers": comm.Get_size() - 1,
              "repeats": args.repeats, "bucket_bytes": int(args.bucket_mb * (1 << 20)), "host": socket.gethostname(),
              "mpi": MPI.Get_library_version().splitlines()[0].strip(), "torch_threads": 1, "results": results}
    rows = [[r["set"], r["transport"], f"{r['bytes'] / 1e6:.1f}", str(r["messages"]), str(r["repeats"]),
             f"{r['raw_median_s'] * 1e3:.2f}", f"{r['send_median_s'] * 1e3:.2f}", f"{r['send_ratio'] * 100:.0f}%",
             f"{r['raw_GBps'] * 1e3:.0f}", f"{r['send_GBps'] * 1e3:.0f}", f"{r['stage_median_s'] * 1e3:.2f}",
             f"{r['publish_median_s'] * 1e3:.2f}", f"{r['publish_ratio'] * 100:.0f}%",
             f"{r['first_publish_s'] * 1e3:.1f}", "yes" if r["verified"] else "NO"]
            for r in results]
    print(f"weight broadcast, 1 source -> {comm.Get_size() - 1} receivers, float32 master -> bf16 wire, "
          f"buckets {args.bucket_mb:g} MB, medians")
    print(format_table(["set", "transport", "MB", "msgs", "reps", "raw ms", "send ms", "send/raw", "raw MB/s",
                        "send MB/s", "stage ms", "publish ms", "publish/raw", "first ms", "bit-identical"], rows))
    print("raw: one Bcast of an already-packed buffer of the same bytes. send: header + every bucket into the "
          "receivers' buffers (engines wait for this), over the transport named. stage: the trainer's cast into "
          "staging (engines keep "
          "generating). publish: stage + send in one call. first: the first publish, which also sends the "
          "manifest and allocates the persistent buffers (not in the medians).")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["verified"] for r in results) else 1


def under_mpi() -> bool:
    """Whether this process is a rank of an MPI launch (or the child `relaunch_under_mpiexec` started)."""
    return _under_mpi() or bool(os.environ.get(CHILD_VAR))


def relaunch_under_mpiexec(module: str, ranks: int, argv: Sequence[str] | None) -> int:
    """Start benchmark `module` again as `ranks` ranks of ``mpiexec`` on this machine, with the same options."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SfhpcError("'mpiexec' not found on PATH: install Open MPI (apt-get install openmpi-bin)")
    env = dict(os.environ, **{CHILD_VAR: "1"})
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    options = list(sys.argv[1:] if argv is None else argv)
    command = [mpiexec, "--oversubscribe", "--bind-to", "none", "-n", str(ranks), sys.executable, "-m", module,
               *options]
    return subprocess.call(command, env=env)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if under_mpi():
        return run_ranks(args)
    return relaunch_under_mpiexec("sfhpc.bench.broadcast", args.ranks, argv)


if __name__ == "__main__":
    run_as_script(main)
