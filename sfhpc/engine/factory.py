"""The rollout engine a recipe asks for (``engine.name``), started on a rollout rank."""

from __future__ import annotations

from pathlib import Path

from sfhpc.config.recipe import Recipe
from sfhpc.engine.base import RolloutEngine


def start_engine(recipe: Recipe, model_dir: Path, rank: int) -> RolloutEngine:
    """A running engine for rank `rank`: vLLM on the policy folder, or the deterministic test engine."""
    if recipe.engine.name == "test":
        from sfhpc.engine.scripted import ScriptedEngine

        return ScriptedEngine(seed=recipe.seed + rank, token_delay=recipe.engine.token_delay_s,
                              max_model_len=recipe.model.max_seq_len, name=f"test-r{rank}")
    from sfhpc.engine.vllm_engine import VllmEngine

    return VllmEngine.start(f"vllm-r{rank}", model_dir, max_model_len=recipe.model.max_seq_len,
                            dtype=recipe.model.dtype, seed=recipe.seed + rank)
