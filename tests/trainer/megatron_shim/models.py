"""A small grouped-query-attention Llama folder (4 query heads sharing 2 key/value heads), so the tests
exercise megatron's per-group [q, k, v] layout and split it over two tensor-parallel ranks."""

from __future__ import annotations

from pathlib import Path

from sfhpc.config.recipe import BuildSpec, ModelSpec

GQA = ModelSpec(build=BuildSpec(layers=2, hidden_size=256, heads=4), max_seq_len=64, dtype="float32")
KV_HEADS = 2


def build_gqa_model(out_dir: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sfhpc.model.tiny import llama_config

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**llama_config(GQA), "num_key_value_heads": KV_HEADS}))
    model.save_pretrained(out)
    return out
