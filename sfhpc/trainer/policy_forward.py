"""The policy's forward as the loss needs it: per-token log-probabilities and entropy, computed in chunks.

A causal LM's forward returns logits ``[rows, length, vocab]``; at a 152k vocabulary that is 0.6 GB per row of
1,024 tokens in float32, more than the rest of a micro-batch's activations, and the log-softmax and its
gradient double it. The loss needs one number per token (the log-probability of the token that was
sampled), so `PolicyLM` runs the decoder to its last hidden states and applies the output layer a chunk of
``chunk_tokens`` positions at a time: each chunk's logits live only inside a checkpointed function that
returns the chunk's log-probabilities (and, without a gradient, its entropy), and are computed again in the
backward. At most one chunk's logits exist at any moment, whatever the batch.

The module holds the Hugging Face model as its child ``lm``; sharding (`sfhpc.trainer.sharding`) wraps this
module as the root, so a call of it gathers the output layer and the embeddings as a forward does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 1024


class PolicyLM(torch.nn.Module):
    """``forward(tokens, attention_mask, temperatures)`` -> ``(logprobs, entropy)``, each ``[rows, length]``:
    the log-probability of token ``t`` given the tokens before it, at the temperature it was sampled with, and
    the entropy of that distribution (detached); position 0 has no context and gets 0 in both."""

    def __init__(self, lm: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, found {chunk_tokens}")
        self.lm: Any = lm  # a transformers causal LM (its decoder and output layer are called by name)
        self.chunk_tokens = chunk_tokens
        # Gemma 2 and its kin cap their logits (z -> c * tanh(z / c)): the trainer must score as the model does.
        self.softcap = getattr(getattr(lm, "config", None), "final_logit_softcapping", None)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        decoder = self.lm.get_decoder()
        hidden = decoder(input_ids=tokens, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # Positions 0..T-2 predict tokens 1..T-1: flatten them so chunks are of tokens, not rows.
        rows, length = tokens.shape
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = tokens[:, 1:].reshape(-1)
        temps = temperatures[:, 1:].reshape(-1).to(h.device)
        head = self.lm.get_output_embeddings()
        logps, ents = [], []
        for start in range(0, h.shape[0], self.chunk_tokens):
            end = start + self.chunk_tokens
            args = (head.weight, head.bias, h[start:end], targets[start:end], temps[start:end])
            if torch.is_grad_enabled():
                lp, ent = checkpoint(self._chunk, *args, use_reentrant=False)
            else:
                lp, ent = self._chunk(*args)
            logps.append(lp)
            ents.append(ent)
        shape = (rows, length - 1)
        logprobs = torch.cat(logps).reshape(shape) if logps else h.new_zeros(shape, dtype=torch.float32)
        entropy = torch.cat(ents).reshape(shape) if ents else h.new_zeros(shape, dtype=torch.float32)
        return torch.nn.functional.pad(logprobs, (1, 0)), torch.nn.functional.pad(entropy, (1, 0))

    def _chunk(self, weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor, targets: torch.Tensor,
               temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The head's own bias is rare in decoders; where there is one it is added as the model would.
        logits = torch.nn.functional.linear(hidden, weight, bias)
        logits = logits.float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits / temperatures.unsqueeze(-1)
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        return picked, entropy
