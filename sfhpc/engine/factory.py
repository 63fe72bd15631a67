"""The rollout engine a recipe asks for (``engine.name``), started on a rollout rank."""

from __future__ import annotations

from pathlib import Path

from sfhpc.config.recipe import Recipe
from sfhpc.engine.base import RolloutEngine


def start_engine(recipe: Recipe, model_dir: Path, rank: int) -> RolloutEngine:
    """A running engine for rank `rank`: vLLM on the policy folder, or the deterministic test engine."""
    spec = recipe.engine
    if spec.name == "test":
        from sfhpc.engine.scripted import DEFAULT_VOCAB, ScriptedEngine
        from sfhpc.engine.tokenizer import END

        # Without the end marker the engine never stops a reply itself: it writes to the length bound.
        vocab = tuple(t for t in DEFAULT_VOCAB if t != END) if spec.writes_to_budget else DEFAULT_VOCAB
        return ScriptedEngine(seed=recipe.seed + rank, vocab=vocab, token_delay=spec.token_delay_s,
                              per_sequence_delay=spec.per_sequence_s, prefill_delay=spec.prefill_per_token_s,
                              load_delay=spec.weight_load_s, max_model_len=recipe.model.max_seq_len,
                              name=f"test-r{rank}")
    from sfhpc.engine.vllm_engine import VllmEngine

    return VllmEngine.start(f"vllm-r{rank}", model_dir, max_model_len=recipe.model.max_seq_len,
                            dtype=recipe.model.dtype, seed=recipe.seed + rank)
