"""Model shapes by name, and folders of a shape with random weights: what benchmarks and memory plans size.

The shapes are those of published Qwen2.5 models (their ``config.json``: layers, widths, heads, vocabulary,
tied output layer). A folder built here has that architecture with random weights and no tokenizer: enough
for the trainer (which reads token ids) and the memory plan, never for generation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's shape as its ``config.json`` gives it (Qwen2 architecture: q/k/v biases, SwiGLU MLP)."""

    layers: int
    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    vocab_size: int
    tied: bool

    def config(self, *, vocab_size: int | None = None, max_seq_len: int = 4096) -> Any:
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=vocab_size or self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           max_position_embeddings=max_seq_len, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           tie_word_embeddings=self.tied, use_sliding_window=False, dtype="bfloat16")


SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(24, 896, 4864, 14, 2, 151936, True),
    "qwen2.5-1.5b": Shape(28, 1536, 8960, 12, 2, 151936, True),
    "qwen2.5-3b": Shape(36, 2048, 11008, 16, 2, 151936, True),
    "qwen2.5-7b": Shape(28, 3584, 18944, 28, 4, 152064, False),
    "qwen2.5-14b": Shape(48, 5120, 13824, 40, 8, 152064, False),
    "qwen2.5-32b": Shape(64, 5120, 27648, 40, 8, 152064, False),
    "qwen2.5-72b": Shape(80, 8192, 29568, 64, 8, 152064, False),
    # Small enough for a test: the 0.5B's proportions at a fraction of its width and depth.
    "tiny": Shape(2, 128, 352, 2, 1, 1024, True),
}


def shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape '{name}'; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def build_shaped_model(out_dir: str | Path, name: str, *, vocab_size: int | None = None, seed: int = 0,
                       max_seq_len: int = 4096) -> Path:
    """A Hugging Face folder (``config.json``, ``model.safetensors`` in bf16) of shape `name` with random
    weights drawn from `seed`; `vocab_size` replaces the shape's vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = shape(name).config(vocab_size=vocab_size, max_seq_len=max_seq_len)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out
