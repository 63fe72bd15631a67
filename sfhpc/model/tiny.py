"""The model sfhpc builds when a recipe names no ``model.path``: a small Hugging Face folder, made on the spot.

It is an ordinary Hugging Face folder (`sfhpc.model.hf_folder`): a byte-level BPE tokenizer trained here on
generated sentences and on the text of the run's task (so the task's prompts and replies are a few tokens
each), a chat template (``model.build.chat_format``; by default the brief one,
`sfhpc.model.hf_folder.BRIEF_TEMPLATE`), and random weights from the
recipe's seed. Engine, endpoint, trainer and warm start load it as they load any user's folder, through
``AutoTokenizer`` and ``AutoModelForCausalLM``; nothing in sfhpc treats it otherwise. No hub download.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import ModelSpec
from sfhpc.model.hf_folder import FORMATS, HEAD_DIM, build_hf_model, rendered_pieces
from sfhpc.tasks.base import Task

TASK_TEXT_CONVERSATIONS = 2000  # the task's format examples the tokenizer is trained on


def task_texts(task: Task, seed: int, chat_format: str, conversations: int = TASK_TEXT_CONVERSATIONS) -> Iterator[str]:
    """The task's format examples (`Task.warm_start_examples`, which leave the task's own sampler where it
    is) as `chat_format`'s template writes them, with the task's tools: the messages, and the tool calls
    and tool list in the template's spelling, so that a call is a few tokens too."""
    rng = random.Random(seed)
    chat = FORMATS[chat_format]
    for conversation in task.warm_start_examples(rng, conversations):
        yield from rendered_pieces(chat, conversation, tools=task.tools)


def build_tiny_model(spec: ModelSpec, out_dir: str | Path, seed: int = 0, task: Task | None = None) -> Path:
    """Train the tokenizer (on `task`'s text too, when given), initialise the model from `seed` and save the
    folder into `out_dir`."""
    shape = spec.build
    texts = list(task_texts(task, seed, shape.chat_format)) if task is not None else []
    return build_hf_model(out_dir, shape.architecture, layers=shape.layers, hidden_size=shape.hidden_size,
                          heads=shape.heads, tokenizer_vocab=shape.tokenizer_vocab, max_seq_len=spec.max_seq_len,
                          dtype=spec.dtype, seed=seed, texts=texts, chat_format=shape.chat_format)


def llama_config(spec: ModelSpec) -> dict[str, Any]:
    """The ``LlamaConfig`` keys of a Llama shaped by `spec`, with the embedding rows a built tokenizer of
    ``spec.build.tokenizer_vocab`` tokens gets: the weights' shapes, for benchmarks and tests that need the
    default model's tensors without building its tokenizer."""
    shape = spec.build
    if shape.hidden_size != shape.heads * HEAD_DIM:
        raise ValueError(f"hidden_size must be heads x {HEAD_DIM} = {shape.heads * HEAD_DIM} (vLLM's CPU attention "
                         f"needs head_dim {HEAD_DIM}), found {shape.hidden_size}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": -(-shape.tokenizer_vocab // 64) * 64,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.hidden_size * 8 // 3 // 16 * 16,   # SwiGLU's usual 8/3, rounded to 16
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
    }
