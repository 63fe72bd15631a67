"""Trainer steps on a model of a published shape, per setting: tokens/s and each rank's peak memory against
the memory plan.

    sfhpc bench train [--shape qwen2.5-0.5b] [--vocab 32768] [--ranks 2] [--rows 16] [--length 1024]
                      [--micro-batch-tokens 1024] [--steps 1] [--settings sharded-bf16-ckpt,whole-fp32,...]
                      [--json FILE]

The model is built here with random weights (`sfhpc.model.shapes`, no tokenizer: the batch is random token
ids, half of each row generated, rewards 0 or 1 in groups of 8). Each setting runs in fresh processes, one per
trainer rank (gloo on CPUs, NCCL on GPUs), so each rank's peak is its own:

* ``sharded-bf16-ckpt``: FSDP2 over ``--ranks``, bf16 compute, activation checkpointing, the micro-batches;
* ``whole-fp32``: the whole model on one rank, float32, no checkpointing, the same micro-batches (one rank:
  a data-parallel rank holds the same and DDP's gradient buckets besides, so this is its lower bound);
* ``whole-fp32-full-batch``: as ``whole-fp32`` with every row of the rank in one pass: the plan judges it
  first and, where it does not fit the rank's memory, refuses it in one line instead of running it;
* ``megatron-bf16-dopt-ckpt``: the megatron backend over ``--ranks`` data-parallel ranks (tensor and pipeline
  parallel 1), bf16, the distributed optimizer, full recompute, equal micro-batches;
* ``megatron-fp32``: the megatron backend on one rank, float32, no recompute. megatron-core needs CUDA: on a
  machine without it the megatron settings are refused in one line (the tests run them through their CPU
  shim, ``tests/trainer/megatron_shim/site`` on ``PYTHONPATH``).

Before each run the plan (`sfhpc.plan.memory`) is printed for its ranks; after it, the measured peak
(CPU: the process's peak resident memory, VmHWM; GPU: the allocator's peak) beside the plan's total, and
tokens/s over the steps after the first (the first allocates Adam's state; with one step, that one). A
setting whose plan exceeds the rank's memory (GPU: its memory; CPU: this host's memory over the ranks that
share it) is refused. The ratios, measured in one run, are the figures; absolute speeds depend on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sfhpc.plan.memory import (
    MegatronSettings,
    ModelShape,
    RankMemory,
    TrainerSetup,
    equal_micro_batches,
    gib,
    megatron_memory,
    micro_batch_tokens,
    trainer_memory,
)
from sfhpc.table import format_table

SETTINGS = ("sharded-bf16-ckpt", "whole-fp32", "whole-fp32-full-batch")
# Dense bf16 matrix rate of the GPUs model FLOPs utilisation is reported against (vendors' datasheets).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def model_flops_per_token(shape: ModelShape, length: int) -> float:
    """A training step's FLOPs per token: 6 per parameter (forward and backward), and causal attention's
    scores and sums (PaLM's accounting, halved for the causal mask). Recomputation is not counted (MFU)."""
    return 6 * shape.params + 6 * shape.layers * shape.heads * shape.head_dim * length


def peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    ranks: int
    sharding: str
    precision: str
    checkpointing: bool
    micro_batch_tokens: int | None
    backend: str = "torch"

    def training(self, chunk: int) -> Any:
        from sfhpc.config.recipe import TrainingSpec

        return TrainingSpec(backend=self.backend, precision=self.precision, sharding=self.sharding,  # type: ignore[arg-type]
                            micro_batch_tokens=self.micro_batch_tokens, activation_checkpointing=self.checkpointing,
                            logprob_chunk_tokens=chunk)


def settings(names: list[str], ranks: int, micro: int) -> list[Setting]:
    table = {
        "sharded-bf16-ckpt": Setting("sharded-bf16-ckpt", ranks, "full", "bf16", True, micro),
        "sharded-fp32": Setting("sharded-fp32", ranks, "full", "float32", False, micro),
        "whole-fp32": Setting("whole-fp32", 1, "none", "float32", False, micro),
        "whole-fp32-full-batch": Setting("whole-fp32-full-batch", 1, "none", "float32", False, None),
        "megatron-bf16-dopt-ckpt": Setting("megatron-bf16-dopt-ckpt", ranks, "full", "bf16", True, micro, "megatron"),
        "megatron-fp32": Setting("megatron-fp32", 1, "none", "float32", False, micro, "megatron"),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"sfhpc bench train: unknown setting {unknown[0]!r}; known: {', '.join(table)}")
    return [table[n] for n in names]


def plan_for(shape: ModelShape, setting: Setting, *, local_rows: int, length: int, device: str, chunk: int,
             capacity: int) -> RankMemory:
    """The plan of one rank of `setting` that trains `local_rows` rows of `length` tokens a step."""
    if setting.backend == "megatron":
        count = equal_micro_batches(local_rows, length, setting.micro_batch_tokens, 1)
        settings = MegatronSettings.from_training(setting.training(chunk), tensor=1, data=setting.ranks,
                                                  on_gpu=device == "gpu")
        return megatron_memory(shape, settings, tensor_parallel=1, pipeline_parallel=1, data_parallel=setting.ranks,
                               tokens=local_rows // count * length, reference=False, capacity=capacity,
                               device=device)
    tokens = micro_batch_tokens(setting.micro_batch_tokens, local_rows, length)
    return trainer_memory(shape, TrainerSetup(
        ranks=setting.ranks, sharded=setting.sharding == "full", precision=setting.precision,
        micro_batch_tokens=tokens, activation_checkpointing=setting.checkpointing, logprob_chunk_tokens=chunk,
        device=device), capacity)


def peak_bytes(device: Any) -> int:
    """This process's peak: the allocator's on CUDA, resident memory (VmHWM) on the CPU."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def random_batch(vocab: int, rows: int, length: int, seed: int = 0) -> Any:
    """Rows of random tokens, the second half of each generated, rewards 0 or 1 in groups of 8."""
    import torch

    from sfhpc.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (rows, length), generator=g)
    generated = torch.zeros(rows, length, dtype=torch.bool)
    generated[:, length // 2:] = True
    return TrainBatch(tokens=tokens, lengths=torch.full((rows,), length), generated=generated,
                      behaviour_logprobs=torch.where(generated, -float(torch.log(torch.tensor(vocab))), 0.0),
                      versions=torch.where(generated, 0, -1),
                      rewards=torch.randint(0, 2, (rows,), generator=g).float(),
                      groups=tuple(i // 8 for i in range(rows)))


def run_rank(rank: int, world: int, address: str, folder: str, setting: Setting, rows: int, length: int,
             steps: int, chunk: int, out: Any) -> None:
    """One trainer rank of a setting: builds the trainer, trains `steps` steps of `rows` rows of its own, reports
    its figures."""
    import torch

    from sfhpc.config.recipe import AlgorithmSpec
    from sfhpc.trainer.distributed import DistSpec

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if cuda else "gloo"
    dist = DistSpec(rank=rank, world_size=world, init_method=address, backend=backend) if world > 1 else None
    start = time.perf_counter()
    algorithm, training = AlgorithmSpec(learning_rate=1e-6), setting.training(chunk)
    trainer: Any
    if setting.backend == "megatron":
        from sfhpc.trainer.megatron_backend import MegatronTrainer

        trainer = MegatronTrainer(folder, algorithm, training=training, dist=dist)
        vocab, model = trainer.layout.vocab_size, trainer.module
        params = sum(p.numel() for p in model.parameters())  # tensor and pipeline parallel 1: the whole model
    else:
        from sfhpc.trainer.torch_trainer import TorchTrainer

        trainer = TorchTrainer(folder, algorithm, dist=dist, device=device, training=training)
        vocab, model = trainer.model.config.vocab_size, trainer.model
        params = sum(p.numel() for p in model.parameters()) * (world if trainer.sharded else 1)
    built_s = time.perf_counter() - start
    seconds, first = [], None
    for step in range(steps):
        # Each rank trains its own rows (advantages of a whole batch are set: every row counts as one group's).
        batch = random_batch(vocab, rows, length, seed=step * world + rank)
        batch = batch.with_advantages(trainer.advantages(batch))
        metrics = trainer.train_step(batch, sharded=True)
        if first is None:
            first = metrics
        seconds.append(metrics.seconds)
        if rank == 0:
            print(f"  {setting.name}: step {step + 1}/{steps} {metrics.seconds:.1f} s, loss {metrics.loss:.5f}, "
                  f"grad norm {metrics.grad_norm:.4f}, {metrics.micro_batches} micro-batches", flush=True)
    timed = seconds[1:] or seconds
    out.put({"rank": rank, "peak": peak_bytes(trainer.device), "build_s": built_s, "step_s": seconds,
             "tokens_per_s": world * rows * length / (sum(timed) / len(timed)),
             "params": params,
             "loss": first.loss if first else None, "grad_norm": first.grad_norm if first else None})


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_setting(folder: Path, setting: Setting, *, rows: int, length: int, steps: int, chunk: int) -> list[dict]:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    out = context.Queue()
    address = free_address()
    procs = [context.Process(target=run_rank, args=(r, setting.ranks, address, str(folder), setting, rows, length,
                                                   steps, chunk, out)) for r in range(setting.ranks)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        results.append(out.get(timeout=24 * 3600))
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode]
    if failed:
        raise RuntimeError(f"setting {setting.name}: a rank exited with {failed[0]}")
    return sorted(results, key=lambda r: r["rank"])


def megatron_runs_here() -> bool:
    """Whether the megatron backend starts on this machine: CUDA, or a CPU shim that lifted its requirement."""
    import torch

    from sfhpc.trainer import megatron_backend

    return torch.cuda.is_available() or not megatron_backend.REQUIRE_CUDA


def rank_capacity(device: str, ranks_on_host: int) -> int:
    if device == "gpu":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages // max(ranks_on_host, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sfhpc bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="a model shape (sfhpc.model.shapes)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default 32768; 0: the shape's)")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks of the sharded settings")
    parser.add_argument("--rows", type=int, default=16, help="rows of the global batch")
    parser.add_argument("--length", type=int, default=1024, help="tokens per row")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512, help="training.logprob_chunk_tokens")
    parser.add_argument("--steps", type=int, default=2,
                        help="steps per setting (the second holds Adam's state through its forward: the peak)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated (default {','.join(SETTINGS)})")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    import torch

    from sfhpc.model.shapes import build_shaped_model

    device = "gpu" if torch.cuda.is_available() else "cpu"
    chosen = settings([s for s in args.settings.split(",") if s], args.ranks, args.micro_batch_tokens)
    report: dict[str, Any] = {"shape": args.shape, "vocab": args.vocab, "ranks": args.ranks, "rows": args.rows,
                              "length": args.length, "device": device, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="sfhpc-bench-train-") as tmp:
        start = time.perf_counter()
        folder = build_shaped_model(Path(tmp) / "model", args.shape, vocab_size=args.vocab or None,
                                    max_seq_len=max(args.length, 128))
        shape = ModelShape.from_folder(folder)
        print(f"bench train: {args.shape} ({shape.params / 1e9:.3f}B parameters, vocab {shape.vocab}) built in "
              f"{time.perf_counter() - start:.1f} s; batch {args.rows} x {args.length} tokens on {device}", flush=True)
        rows_table = []
        top = peak_flops()
        # Every rank, sharded or whole, trains one data-parallel rank's share of the global batch.
        local_rows = -(-args.rows // args.ranks)
        for setting in chosen:
            if setting.backend == "megatron" and device == "cpu" and not megatron_runs_here():
                print(f"  {setting.name}: refused: megatron-core needs CUDA GPUs (training.backend 'megatron')",
                      flush=True)
                report["settings"][setting.name] = {"refused": True, "why": "no CUDA"}
                rows_table.append([setting.name, "refused", "-", "-", "-", "-"])
                continue
            on_host = setting.ranks if device == "cpu" else 1
            plan = plan_for(shape, setting, local_rows=local_rows, length=args.length, device=device,
                            chunk=args.chunk, capacity=rank_capacity(device, on_host))
            print(f"  plan {setting.name} ({setting.ranks} rank(s)): {plan.describe()}", flush=True)
            entry: dict[str, Any] = {"plan": dict(plan.items), "plan_total": plan.total, "capacity": plan.capacity}
            if not plan.fits:
                print(f"  {setting.name}: refused by the plan: {gib(plan.total)} per rank > {gib(plan.capacity)}; "
                      "use micro-batches (training.micro_batch_tokens), sharding or checkpointing", flush=True)
                entry["refused"] = True
                report["settings"][setting.name] = entry
                rows_table.append([setting.name, "refused", "-", "-", gib(plan.total), "-"])
                continue
            results = run_setting(folder, setting, rows=local_rows, length=args.length, steps=args.steps,
                                  chunk=args.chunk)
            peak = max(r["peak"] for r in results)
            # On a GPU the allocator's peak is measured: the plan's part of it leaves out the runtime reserve.
            planned = plan.total - (plan.item("runtime reserve") if device == "gpu" else 0)
            rate = results[0]["tokens_per_s"]
            mfu = rate * model_flops_per_token(shape, args.length) / top / setting.ranks if top else None
            entry.update(results=results, peak=peak, peak_over_plan=peak / planned, tokens_per_s=rate, mfu=mfu,
                         loss=results[0]["loss"], grad_norm=results[0]["grad_norm"])
            report["settings"][setting.name] = entry
            rows_table.append([setting.name, f"{rate:.0f}", "-" if mfu is None else f"{mfu:.1%}", gib(peak),
                               gib(planned), f"{peak / planned:.2f}"])
        print(format_table(["setting", "tokens/s", "MFU", "peak per rank", "plan", "peak/plan"], rows_table))
        done = {k: v for k, v in report["settings"].items() if "peak" in v}
        if "sharded-bf16-ckpt" in done and "whole-fp32" in done:
            ratio = done["sharded-bf16-ckpt"]["peak"] / done["whole-fp32"]["peak"]
            report["sharded_over_whole_peak"] = ratio
            print(f"peak per rank, sharded bf16 with checkpointing / whole float32: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
