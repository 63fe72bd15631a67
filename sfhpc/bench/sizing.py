"""The sizing table of docs/gpus.md: the memory plan of one trainer GPU for published model shapes and layouts.

    sfhpc bench sizing [--seq 4096] [--micro-batch-tokens 16384] [--gpu-gib 80]

For each shape (`sfhpc.model.shapes`) and number of trainer GPUs, the torch backend sharded over them with bf16
compute, activation checkpointing, micro-batches of ``--micro-batch-tokens`` and the default log-probability
chunk: the bytes one trainer rank holds at its peak by `sfhpc.plan.memory` (weights, gradients and Adam's state
sharded; the gathered layers; activations; one chunk of logits; the runtime's reserve), and whether that fits a
GPU of ``--gpu-gib`` (95% usable). Nothing runs: the table is the plan, printed as markdown.
"""

from __future__ import annotations

import argparse
import sys

from sfhpc.plan.memory import GIB, ModelShape, TrainerSetup, micro_batch_tokens, trainer_memory

ROWS = (("qwen2.5-1.5b", (1, 8)), ("qwen2.5-7b", (1, 8, 16)), ("qwen2.5-14b", (8, 16, 32)),
        ("qwen2.5-32b", (16, 32, 64)))
USABLE = 0.95


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sfhpc bench sizing", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="the longest sequence (model.max_seq_len)")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=1024, help="training.logprob_chunk_tokens")
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    args = parser.parse_args(argv)
    from sfhpc.model.shapes import shape

    print("| model | trainer GPUs | weights + gradients + Adam | gathered | activations | logits chunk | "
          f"total per GPU | fits {args.gpu_gib:g} GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, counts in ROWS:
        model = ModelShape.from_config({**shape(name).config().to_dict(), "model_type": "qwen2"})
        for gpus in counts:
            tokens = micro_batch_tokens(args.micro_batch_tokens, args.micro_batch_tokens // args.seq + 1, args.seq)
            plan = trainer_memory(model, TrainerSetup(
                ranks=gpus, sharded=True, precision="bf16", micro_batch_tokens=tokens, activation_checkpointing=True,
                logprob_chunk_tokens=args.chunk, device="gpu"), int(args.gpu_gib * GIB * USABLE))
            state = plan.item("weights") + plan.item("gradients") + plan.item("optimizer")
            print(f"| {name} ({model.params / 1e9:.2f}B) | {gpus} | {state / GIB:.1f} | "
                  f"{plan.item('gathered weights and gradients') / GIB:.1f} | {plan.item('activations') / GIB:.1f} | "
                  f"{plan.item('logits chunk') / GIB:.1f} | {plan.total / GIB:.1f} | {'yes' if plan.fits else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
