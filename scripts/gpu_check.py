"""The prepared check of one GPU machine: sfhpc's trainer and weight publish on CUDA, in a few minutes.

It needs what a GPU image has (torch, transformers, safetensors, tokenizers) and sfhpc itself (carried as a
wheel where no registry can be reached); no vLLM. In order:

1. builds a model folder locally (Qwen2, about 0.5B parameters; ``--dry-run``: a tiny one);
2. trains it with the torch backend's defaults (`sfhpc.trainer.torch_trainer.TorchTrainer` on ``cuda``: sharded
   over a group of one, float32 master weights, bf16 compute) for a few GRPO steps on random token batches;
3. publishes the bf16 weights from this (trainer) process to a receiver process on the same device through
   torch.multiprocessing, which hands CUDA tensors over as CUDA IPC handles (CPU tensors, with ``--dry-run``,
   as shared memory), and times the receiver's copy into its own buffers (GB/s);
4. runs `sfhpc bench train` on a model of Qwen2.5-1.5B's shape (its 151,936-token vocabulary; ``--dry-run``: the
   tiny shape): the sharded bf16 trainer with activation checkpointing, and the whole model in float32 beside
   it, each rank's peak memory against the memory plan, tokens/s and model FLOPs utilisation;
5. exports the trained policy as a Hugging Face folder (`sfhpc.rl.export`, bf16), loads it with transformers on
   the device and measures its log-probabilities of the batch against the trainer's (the reload gap);
6. writes one JSON: the machine, each phase's seconds, tokens/s, GB/s, peak memory per process.

``--dry-run`` runs the same flow on the CPU (the suite runs it); without it a missing GPU is an error.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# Qwen2.5-0.5B's widths (hidden 896, 24 layers, 14 query and 2 key/value heads of 64), a narrower MLP (the
# project's builder's 8/3 of the hidden size) and the vocabulary its tokenizer reaches on the generated corpus:
# about 0.2B parameters (the report counts them).
FULL = {"layers": 24, "hidden_size": 896, "heads": 14, "kv_heads": 2, "tokenizer_vocab": 32768}
TINY = {"layers": 2, "hidden_size": 128, "heads": 2, "kv_heads": 1, "tokenizer_vocab": 300}


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak: device memory on CUDA, resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # VmHWM, not getrusage's ru_maxrss, which a spawned process inherits across exec from its parent.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def receive(queue: Any, done: Any) -> None:
    """The receiver process: takes the published tensors, copies them into buffers of its own and reports."""
    tensors = queue.get()
    device = tensors[0].device
    own = [torch.empty_like(t) for t in tensors]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for mine, theirs in zip(own, tensors):
        mine.copy_(theirs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    done.put({"copy_s": seconds, "bytes": sum(t.numel() * t.element_size() for t in own),
              "peak_mib": peak_memory_mib(device)})
    queue.get()  # hold the handles until the publisher has its answer


def random_batch(vocab: int, rows: int, length: int, group: int) -> Any:
    """A GRPO batch of random tokens: the second half of each row generated, rewards 0 or 1."""
    from sfhpc.trainer.batch import TrainBatch

    tokens = torch.randint(3, vocab, (rows, length))
    generated = torch.zeros(rows, length, dtype=torch.bool)
    generated[:, length // 2:] = True
    return TrainBatch(tokens=tokens, lengths=torch.full((rows,), length), generated=generated,
                      behaviour_logprobs=torch.where(generated, -5.0, 0.0),
                      versions=torch.where(generated, 0, -1), rewards=torch.randint(0, 2, (rows,)).float(),
                      groups=tuple(i // group for i in range(rows)))


def export_gap(trainer: Any, folder: Path, tmp: Path, device: torch.device) -> dict[str, Any]:
    """Step 5: the trainer's state as a run checkpoint, exported, reloaded with transformers; the gap between its
    log-probabilities of a batch and the trainer's."""
    from transformers import AutoModelForCausalLM

    from sfhpc.data.store_writer import TrajectoryStore
    from sfhpc.rl.checkpoints import TRAINER_FILE, RunCheckpoints
    from sfhpc.rl.export import export

    start = time.perf_counter()
    run = tmp / "run"
    run.mkdir()
    TrajectoryStore.create(run / "trajectories.h5", run_metadata={"model": str(folder)}).close()
    checkpoints = RunCheckpoints(run)
    partial = checkpoints.begin(trainer.step)
    trainer.save_checkpoint(partial / TRAINER_FILE)
    checkpoints.commit(partial, step=trainer.step, version=trainer.policy_version, identity={}, reason="gpu-check")
    out = export(run, tmp / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(device).eval()
    batch = random_batch(trainer.model.config.vocab_size, 4, 256, group=4)
    with torch.no_grad():
        gap = (trainer.logprobs(batch, loaded) - trainer.logprobs(batch)).abs()[batch.generated.to(device)]
    return {"seconds": round(time.perf_counter() - start, 2), "max_gap": float(gap.max()),
            "mean_gap": float(gap.mean()), "tokens": int(gap.numel())}


def bench_train(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Step 4: `sfhpc bench train` in processes of its own (each setting's peak is its own), its JSON read back."""
    from sfhpc.bench import train

    out = folder / "bench_train.json"
    shape = args.bench_shape or ("tiny" if args.dry_run else "qwen2.5-1.5b")
    sizes = (["--rows", "4", "--length", "64", "--micro-batch-tokens", "128", "--chunk", "64", "--steps", "2"]
             if args.dry_run else
             ["--rows", "16", "--length", "2048", "--micro-batch-tokens", "8192", "--chunk", "2048", "--steps", "3"])
    start = time.perf_counter()
    train.main(["--shape", shape, "--vocab", "0", "--ranks", "1", *sizes,
                "--settings", "sharded-bf16-ckpt,whole-fp32", "--json", str(out)])
    report = json.loads(out.read_text())
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same flow on the CPU with a tiny model")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON written")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 5; dry run 2)")
    parser.add_argument("--bench-shape", default=None, help="the shape of step 4 (default qwen2.5-1.5b; dry run: tiny)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device; run it on a GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    from sfhpc.config.recipe import AlgorithmSpec
    from sfhpc.model.hf_folder import build_hf_model
    from sfhpc.trainer.torch_trainer import TorchTrainer

    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = TINY if args.dry_run else FULL
    steps = args.steps or (2 if args.dry_run else 5)
    rows, length = (8, 32) if args.dry_run else (32, 512)
    report: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "dry_run": args.dry_run, "model": shape}
    with tempfile.TemporaryDirectory(prefix="sfhpc-gpu-check-") as tmp:
        start = time.perf_counter()
        folder = build_hf_model(Path(tmp) / "model", "qwen2", max_seq_len=max(length, 64), dtype="bfloat16",
                                **shape)
        report["build_s"] = round(time.perf_counter() - start, 2)
        print(f"gpu_check: model built in {report['build_s']} s", flush=True)

        trainer = TorchTrainer(folder, AlgorithmSpec(learning_rate=1e-5), device=str(device))
        report["parameters"] = sum(p.numel() for p in trainer.model.parameters())
        step_s = []
        for step in range(steps):
            # train_step reads the loss and the gradient norm back, so its seconds include the device's work.
            metrics = trainer.train_step(random_batch(trainer.model.config.vocab_size, rows, length, group=8))
            step_s.append(metrics.seconds)
            print(f"gpu_check: step {step + 1}/{steps}: {metrics.seconds:.2f} s, loss {metrics.loss:.4f}",
                  flush=True)
        warm = step_s[1:] or step_s
        report["train_step_s"] = [round(s, 4) for s in step_s]
        report["train_tokens_per_s"] = round(rows * length / (sum(warm) / len(warm)), 1)
        report["trainer_peak_mib"] = round(peak_memory_mib(device), 1)

        report["export"] = export_gap(trainer, folder, Path(tmp), device)
        print(f"gpu_check: export reloaded, log-probability gap max {report['export']['max_gap']:.4f}, mean "
              f"{report['export']['mean_gap']:.5f} nats", flush=True)

        weights = [t.contiguous() for _, t in trainer.named_weights(torch.bfloat16)]
        context = mp.get_context("spawn")
        queue, done = context.Queue(), context.Queue()
        receiver = context.Process(target=receive, args=(queue, done))
        receiver.start()
        start = time.perf_counter()
        queue.put(weights)
        answer = done.get(timeout=300)
        report["publish_s"] = round(time.perf_counter() - start, 4)
        queue.put(None)
        receiver.join(timeout=60)
        report["publish_bytes"] = answer["bytes"]
        report["receiver_copy_gb_per_s"] = round(answer["bytes"] / max(answer["copy_s"], 1e-9) / 1e9, 2)
        report["receiver_peak_mib"] = round(answer["peak_mib"], 1)
        report["ok"] = receiver.exitcode == 0
        del trainer, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["bench_train"] = bench_train(args, args.out.parent)
    report["ok"] = report["ok"] and bool(report["bench_train"].get("settings"))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_check: {'ok' if report['ok'] else 'FAILED'}: {report['parameters'] / 1e6:.1f}M parameters, "
          f"{report['train_tokens_per_s']} train tokens/s, publish {report['receiver_copy_gb_per_s']} GB/s; "
          f"wrote {args.out}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
