"""The rollout engine a recipe asks for (``engine.name``), started on a rollout rank."""

from __future__ import annotations

import string
from pathlib import Path

from sfhpc.config.recipe import Recipe
from sfhpc.engine.base import RolloutEngine


def start_engine(recipe: Recipe, model_dir: Path, rank: int, *, shares_gpu: bool = False) -> RolloutEngine:
    """A running engine for rank `rank`: vLLM on the policy folder, or the deterministic test engine.
    `shares_gpu`: the rank trains too (colocated, or lent in seamless), so the engine sizes itself to the
    memory the trainer left and sleeps while the trainer trains."""
    spec, timing = recipe.engine, recipe.timing_model
    if spec.name == "test":
        from sfhpc.engine.scripted import ScriptedEngine

        # Without the end-of-turn token the engine never stops a reply itself: it writes to the length bound.
        vocab = scripted_vocab(model_dir, stops=not spec.writes_to_budget)
        return ScriptedEngine(seed=recipe.seed + rank, vocab=vocab, token_delay=spec.token_delay_s,
                              per_sequence_delay=timing.per_sequence_s, prefill_delay=timing.prefill_per_token_s,
                              load_delay=timing.weight_load_s, cut_after=spec.cut_after_tokens,
                              max_model_len=recipe.model.max_seq_len,
                              name=f"test-r{rank}")
    from sfhpc.engine.vllm_engine import VllmEngine

    return VllmEngine.start(f"vllm-r{rank}", model_dir, max_model_len=recipe.model.max_seq_len,
                            dtype=recipe.model.dtype, seed=recipe.seed + rank, knobs=spec, shares_gpu=shares_gpu)


def scripted_vocab(model_dir: Path, *, stops: bool) -> tuple[int, ...]:
    """The test engine's output tokens in the policy folder's own tokenizer, so the endpoint decodes its
    replies as text: the letters, a space and, with `stops`, the chat template's end-of-turn token."""
    from sfhpc.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    ids = [t for text in (*string.ascii_lowercase, " ") for t in tokenizer.encode(text)]
    return tuple(dict.fromkeys(ids + ([tokenizer.chat_stop_ids[0]] if stops else [])))
