"""The distillation teacher's side: a frozen model that scores token sequences (``algorithm.distill``).

A teacher rank holds one whole copy of the teacher (bfloat16 on its GPU, float32 on a CPU) and returns, for
every token of the rows it is sent, the teacher's log-probability of that token given the ones before it, at
the temperature the policy sampled it with: the forward the trainers score the policy with (`PolicyLM`,
log-probabilities a chunk of positions at a time), without a gradient, a micro-batch of at most
``micro_batch_tokens`` padded tokens at a time (the trainers' setting), so a long batch never holds all its
activations at once.

The teacher must speak the policy's tokenizer: a token id means the same text to both, or the scores
compare nothing. `tokenizer_mismatch` says where two folders' tokenizers differ.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from sfhpc.trainer import micro_batches
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.errors import TrainerError
from sfhpc.trainer.policy_forward import DEFAULT_CHUNK_TOKENS, PolicyLM


class TeacherScorer:
    """``score(batch)`` -> the teacher's per-token log-probabilities, ``[rows, length]`` float32."""

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 micro_batch_tokens: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise TrainerError(f"the teacher {self.model_dir} has no config.json: name a Hugging Face model folder "
                               "or a run folder")
        self.device = torch.device(device)
        # The teacher never trains: its weights in the dtype that halves their memory on a GPU.
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        torch.nn.Module.to(model, self.device)
        model.config.use_cache = False
        self.net = PolicyLM(model.eval().requires_grad_(False), chunk_tokens)
        self.micro_batch_tokens = micro_batch_tokens
        self.load_seconds = time.perf_counter() - started
        self.parameters = sum(p.numel() for p in model.parameters())

    def score(self, batch: TrainBatch) -> np.ndarray:
        out = np.zeros(tuple(batch.tokens.shape), np.float32)
        for index in micro_batches.plan_micro_batches(batch.lengths.tolist(), self.micro_batch_tokens):
            piece = micro_batches.trimmed(batch.rows(index)).to(self.device)
            with torch.no_grad():
                logprobs = self.net(piece.tokens, piece.attention_mask, piece.temperatures)[0]
            out[index, :logprobs.shape[1]] = logprobs.float().cpu().numpy()
        # Positions after a row's end hold whatever the padding scored: 0, as the policy's do in a batch.
        positions = np.arange(out.shape[1])[None, :]
        out[positions >= batch.lengths.numpy()[:, None]] = 0.0
        return out


def tokenizer_mismatch(teacher_dir: Path, policy_dir: Path) -> str | None:
    """Why the teacher's tokenizer is not the policy's (the first difference found), or None when they agree on
    every token's id."""
    from transformers import AutoTokenizer

    teacher = AutoTokenizer.from_pretrained(teacher_dir)
    policy = AutoTokenizer.from_pretrained(policy_dir)
    theirs, ours = teacher.get_vocab(), policy.get_vocab()
    if len(theirs) != len(ours):
        return f"the teacher's tokenizer has {len(theirs)} tokens, the policy's {len(ours)}"
    for text, index in ours.items():
        if theirs.get(text) != index:
            return (f"token {text!r} is id {index} for the policy and "
                    f"{theirs.get(text, 'absent')} for the teacher")
    return None
