"""Micro-batches: a rank's rows cut into pieces that fit its memory, trained with gradient accumulation.

A step's gradient is the gradient of one loss over the whole global batch; the memory a forward and backward
need grows with the tokens they see at once (activations, logits). So a rank cuts its rows into
micro-batches of at most ``micro_batch_tokens`` padded tokens (rows x the longest row among them), runs a
forward and backward on each, and lets the gradients add up before the one optimiser step. The loss of each
micro-batch is normalised by the *global* count of tokens (or sequences) of the step, never its own, so the
sum of the micro-batches' gradients is exactly the gradient of the whole batch (`policy_loss`'s
``normaliser``); advantages are computed over the whole global batch first, so GRPO's groups stay whole.

Rows are taken longest first, so rows of like length share a micro-batch and little is spent on padding;
each micro-batch is trimmed to its own longest row. A row longer than the budget gets a micro-batch of its
own (one row cannot be split: its tokens attend to each other).

Ranks that shard their parameters (FSDP) all-gather them in every forward and backward: a rank with fewer
micro-batches than another would leave the others waiting in a collective. `pad_to` adds empty
micro-batches (one token, nothing generated, no weight in the loss) so every rank runs the same number.
"""

from __future__ import annotations

import dataclasses

import torch

from sfhpc.trainer.batch import TrainBatch


def plan_micro_batches(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Row indices per micro-batch: longest rows first, each micro-batch's rows x its longest row within
    `budget` tokens (None or 0: all rows in one micro-batch). Every row is in exactly one micro-batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not budget:
        return [order] if order else []
    pieces: list[list[int]] = []
    for i in order:
        # Rows come longest first, so the first row of a piece is its widest: the piece costs rows x that.
        if pieces and (len(pieces[-1]) + 1) * lengths[pieces[-1][0]] <= budget:
            pieces[-1].append(i)
        else:
            pieces.append([i])
    return pieces


# The batch's [rows, length] fields (advantages are one of them when they are per token).
PER_TOKEN = ("tokens", "generated", "behaviour_logprobs", "versions", "temperatures", "reply_turns", "teacher_logprobs")


def trimmed(batch: TrainBatch) -> TrainBatch:
    """`batch` cut to its longest row (micro-batches drop the padding their rows do not need)."""
    width = max(int(batch.lengths.max()), 1) if batch.size else 1
    if width >= batch.tokens.shape[1]:
        return batch
    cut = {name: getattr(batch, name)[:, :width] for name in PER_TOKEN if getattr(batch, name) is not None}
    if batch.advantages is not None and batch.advantages.dim() == 2:
        cut["advantages"] = batch.advantages[:, :width]
    return dataclasses.replace(batch, **cut)


def split(batch: TrainBatch, budget: int | None) -> list[TrainBatch]:
    """`batch` (advantages already set) as micro-batches of at most `budget` padded tokens each."""
    return [trimmed(batch.rows(index)) for index in plan_micro_batches(batch.lengths.tolist(), budget)]


def empty_like(batch: TrainBatch) -> TrainBatch:
    """A micro-batch of one token with nothing generated: it runs the collectives of a forward and backward
    and adds nothing to the loss or the gradient."""
    one = batch.rows([0]) if batch.size else batch
    return dataclasses.replace(
        one, tokens=one.tokens[:, :1], lengths=torch.ones(1, dtype=torch.int64), generated=one.generated[:, :1] & False,
        behaviour_logprobs=one.behaviour_logprobs[:, :1] * 0, versions=one.versions[:, :1] * 0 - 1,
        temperatures=torch.ones(1, 1), rewards=one.rewards[:1] * 0,
        advantages=None if one.advantages is None else (one.advantages[:, :1] if one.advantages.dim() == 2
                                                        else one.advantages[:1]) * 0,
        turn_rewards=None, reply_turns=None, teacher_logprobs=None)


def pad_to(pieces: list[TrainBatch], count: int, like: TrainBatch) -> list[TrainBatch]:
    """`pieces` followed by empty micro-batches up to `count`."""
    return pieces + [empty_like(like) for _ in range(count - len(pieces))]
