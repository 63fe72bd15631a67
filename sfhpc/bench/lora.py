"""LoRA weight updates two ways, in one run: merged into the engine's weights (what sfhpc does) or served
beside them by vLLM's own LoRA support.

    sfhpc bench lora [--layers 4] [--hidden 512] [--rank 8] [--prompts 16] [--tokens 64] [--versions 3]
                     [--model DIR] [--dtype bfloat16]

On a built model (or ``--model``, a Hugging Face folder) and an adapter of ``--rank`` on every linear layer
(its ``B`` drawn at random, as after some training; a new draw each version), each way runs a vLLM engine:

* **merge**: the engine serves plain weights; a version is the adapter's tensors, merged into the folder's
  frozen weights (`sfhpc.weights.adapter.AdapterMerge`) and reloaded in place, as a rollout rank does;
* **vllm-lora**: the engine runs with ``enable_lora``; a version is an adapter folder written to disk and a new
  ``LoRARequest`` naming it, which vLLM loads with the first request that uses it.

For each it reports the decode throughput of a batch of ``--prompts`` greedy replies of ``--tokens`` tokens
under an adapter (median over versions), the seconds from a version's tensors to the engine generating with
it (median), and the bytes a version sends against the whole model's, then how many replies the two ways
decode alike token for token: all of them in float32 (the same weights either way); in bf16 a merged weight is
rounded once where vLLM adds a bf16 adapter product, and a random model's near-ties then go either way.
Absolute figures depend on the machine and its load; the ratios, measured in one run, are what this measures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sfhpc.bench import run_as_script
from sfhpc.errors import SfhpcError
from sfhpc.table import format_table

SEED = 0


def _model(args: argparse.Namespace, scratch: Path) -> Path:
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SfhpcError(f"{args.model}: not a Hugging Face model folder (no config.json)")
        return Path(args.model)
    from sfhpc.config.recipe import BuildSpec, ModelSpec
    from sfhpc.model.tiny import build_tiny_model

    spec = ModelSpec(build=BuildSpec(layers=args.layers, hidden_size=args.hidden, heads=args.hidden // 64))
    return build_tiny_model(spec, scratch / "model", seed=SEED)


def _adapters(model_dir: Path, rank: int, versions: int) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """The LoRA spec and `versions` adapter states (PEFT's names) for the model, each with a fresh random B."""
    from transformers import AutoModelForCausalLM

    from sfhpc.config.recipe import LoraSpec
    from sfhpc.trainer import lora

    spec = LoraSpec(rank=rank, alpha=2 * rank, target_modules="all-linear")
    model = lora.attach(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), spec, None)
    generator = torch.Generator().manual_seed(SEED)
    states = []
    for _ in range(versions):
        state = lora.adapter_state(model)
        for name, tensor in state.items():
            if ".lora_B." in name:
                state[name] = 0.02 * torch.randn(tensor.shape, generator=generator)
        states.append(state)
    return spec, states


def _engine(model_dir: Path, args: argparse.Namespace, lora_rank: int | None) -> Any:
    from vllm import LLM

    extra: dict[str, Any] = {} if lora_rank is None else {"enable_lora": True, "max_lora_rank": lora_rank,
                                                          "max_loras": 1}
    return LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True, seed=SEED,
               max_model_len=args.tokens + 16, enable_chunked_prefill=False, **extra)


def _decode(llm: Any, args: argparse.Namespace, lora_request: Any = None) -> tuple[float, list[list[int]]]:
    """Seconds for the batch of greedy replies, and their tokens."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [5 + i, 9 + i, 13 + i, 17]} for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def _first_token(llm: Any, lora_request: Any = None) -> None:
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [5, 9]}], SamplingParams(max_tokens=1, detokenize=False),
                 lora_request=lora_request, use_tqdm=False)


def _measure(llm: Any, args: argparse.Namespace, states: list[dict[str, torch.Tensor]],
             switch: Any) -> dict[str, Any]:
    """Each version in turn: `switch(version, state)` brings it into `llm` (returning the bytes it sent and the
    LoRA request to decode under, if any), timed until the first token; then the batch of replies."""
    switches, decodes, replies, sent = [], [], [], 0
    try:
        _decode(llm, args)  # warm-up
        for version, state in enumerate(states, start=1):
            start = time.perf_counter()
            sent, request = switch(version, state)
            _first_token(llm, request)
            switches.append(time.perf_counter() - start)
            seconds, tokens = _decode(llm, args, request)
            decodes.append(seconds)
            replies.append(tokens)
    finally:
        _shutdown(llm)
    return {"switch": switches, "decode": decodes, "replies": replies, "bytes": sent}


def _merge_way(model_dir: Path, args: argparse.Namespace, spec: Any,
               states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    from sfhpc.engine.vllm_engine import _reload_in_worker, pack_weights
    from sfhpc.trainer import lora
    from sfhpc.weights import adapter

    llm = _engine(model_dir, args, None)
    merge = adapter.AdapterMerge(model_dir, getattr(torch, args.dtype))

    def switch(_version: int, state: dict[str, torch.Tensor]) -> tuple[int, None]:
        wire = [(n, t.to(getattr(torch, args.dtype))) for n, t in adapter.wire(lora.deltas(state, spec.scale))]
        for load in merge.loads(adapter.deltas_of(wire)):
            llm.collective_rpc(_reload_in_worker, args=pack_weights(load))
        llm.reset_prefix_cache()
        return sum(t.numel() * t.element_size() for _, t in wire), None

    return _measure(llm, args, states, switch)


def _vllm_lora_way(model_dir: Path, args: argparse.Namespace, spec: Any, states: list[dict[str, torch.Tensor]],
                   scratch: Path) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    from sfhpc.trainer import lora

    llm = _engine(model_dir, args, spec.rank)

    def switch(version: int, state: dict[str, torch.Tensor]) -> tuple[int, Any]:
        wire = {n: t.to(getattr(torch, args.dtype)) for n, t in state.items()}
        folder = scratch / f"adapter-{version}"
        lora.write_adapter_folder(folder, spec, wire, str(model_dir))
        sent = sum(t.numel() * t.element_size() for t in wire.values())
        return sent, LoRARequest(f"v{version}", version, str(folder))

    return _measure(llm, args, states, switch)


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sfhpc bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a Hugging Face folder (default: a built model)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the built model (a multiple of 64)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    if args.hidden % 64 or args.hidden <= 0:
        raise SfhpcError(f"--hidden {args.hidden}: a positive multiple of 64 (vLLM's CPU attention takes heads of 64)")
    if min(args.layers, args.rank, args.prompts, args.tokens, args.versions) < 1:
        raise SfhpcError("--layers, --rank, --prompts, --tokens and --versions: at least 1 each")
    # sfhpc's reload is a function shipped to vLLM's worker, which vLLM refuses to unpickle unless asked.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    with tempfile.TemporaryDirectory(prefix="sfhpc-bench-lora-") as tmp:
        scratch = Path(tmp)
        model_dir = _model(args, scratch)
        spec, states = _adapters(model_dir, args.rank, args.versions)
        from sfhpc.weights.hf_weights import HfWeights

        itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
        full = itemsize * sum(t.numel() for t in HfWeights(model_dir).values())
        print(f"model {model_dir} ({full / 2**20:.1f} MiB in {args.dtype}), rank {args.rank} on every linear layer, "
              f"{args.versions} versions, {args.prompts} replies x {args.tokens} tokens", flush=True)
        ways = {"merge": _merge_way(model_dir, args, spec, states),
                "vllm-lora": _vllm_lora_way(model_dir, args, spec, states, scratch)}
    tokens = args.prompts * args.tokens
    rows = []
    for name, way in ways.items():
        decode = statistics.median(way["decode"])
        rows.append([name, f"{tokens / decode:,.0f}", f"{statistics.median(way['switch']):.3f}",
                     f"{way['bytes']:,}", f"{100 * way['bytes'] / full:.2f}%"])
    print(format_table(["way", "decode tok/s", "switch s", "bytes a version", "of the model"], rows))
    merge, served = ways["merge"], ways["vllm-lora"]
    ratio = statistics.median(served["decode"]) / statistics.median(merge["decode"])
    same = sum(a == b for m, s in zip(merge["replies"], served["replies"]) for a, b in zip(m, s))
    print(f"decode time, vllm-lora over merge: {ratio:.2f}x; replies the same token for token: {same} of "
          f"{args.prompts * args.versions}")
    return 0


if __name__ == "__main__":
    run_as_script(main)
