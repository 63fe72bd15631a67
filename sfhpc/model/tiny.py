"""Build the project's own small Llama-architecture model, saved so vLLM and torch load it locally.

No hub download: the configuration is written here and the weights are initialised from a seed. The
vocabulary is `sfhpc.engine.tokenizer`'s byte-level one, so engine, endpoint and trainer agree on ids
without a tokenizer file (vLLM runs with ``skip_tokenizer_init=True``). ``head_dim`` is 64 because
vLLM's CPU attention does not support smaller heads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import ModelSpec
from sfhpc.engine import tokenizer as tok

HEAD_DIM = 64


def llama_config(spec: ModelSpec) -> dict[str, Any]:
    """The Hugging Face ``LlamaConfig`` fields of the model a recipe describes."""
    if spec.hidden_size != spec.heads * HEAD_DIM:
        raise ValueError(f"model.hidden_size must be model.heads x {HEAD_DIM} = {spec.heads * HEAD_DIM} "
                         f"(vLLM's CPU attention needs head_dim {HEAD_DIM}), found {spec.hidden_size}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.hidden_size * 8 // 3 // 16 * 16,   # SwiGLU's usual 8/3, rounded to 16
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": tok.BOS,
        "eos_token_id": tok.EOS,
        "pad_token_id": tok.PAD,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
    }


def build_tiny_model(spec: ModelSpec, out_dir: str | Path, seed: int = 0) -> Path:
    """Initialise the model from `seed` and save it (config.json + model.safetensors) into `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**llama_config(spec)))
    model.to(getattr(torch, spec.dtype)).save_pretrained(out)
    # The marker that tells `sfhpc.engine.tokenizer.load_tokenizer` this folder speaks the byte vocabulary.
    marker = {tok.BYTE_MARKER_KEY: "byte", "seed": seed, "spec": spec.__dict__}
    (out / tok.MODEL_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out
