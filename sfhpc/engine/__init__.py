"""Rollout engines: the interface (`base`), a deterministic CPU test engine (`scripted`), the tokenizer."""

from sfhpc.engine.base import EngineStateError, FinishReason, GenerationChunk, GenerationRequest, RolloutEngine

__all__ = ["EngineStateError", "FinishReason", "GenerationChunk", "GenerationRequest", "RolloutEngine"]
