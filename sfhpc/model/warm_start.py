"""A short supervised warm start that teaches a freshly built model the *format* of a task's replies.

A random model writes random bytes and never earns a reward, so policy gradient has nothing to climb.
The task provides conversations whose assistant turns have the right form but not the right content
(`Task.warm_start_examples`); a few steps of cross-entropy on those turns only bring the success rate to
chance level, and RL has to do the rest.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sfhpc.engine.tokenizer import ChatTokenizer, load_tokenizer
from sfhpc.tasks.base import Task


def encode_with_targets(conversation: Sequence[Mapping[str, Any]], tokenizer: ChatTokenizer, *,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it is part of an assistant reply (a target).

    A reply is what the model writes after the chat template's generation prompt, up to and including the
    first stop token: the tokens between the rendering of the messages before it (with the generation
    prompt) and its first stop id. Whatever the template puts after the stop token (ChatML's newline) is
    the template's, not the model's, so it is no target. `tools` (OpenAI's function tools) are rendered as
    the template renders them.
    """
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tools=tools)
    targets = [False] * len(ids)
    stops = set(tokenizer.chat_stop_ids)
    for index, message in enumerate(conversation):
        if message.get("role") != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(conversation[:index], add_generation_prompt=True, tools=tools))
        end = start
        while end < len(ids) and ids[end] not in stops:
            end += 1
        targets[start:end + 1] = [True] * (min(end + 1, len(ids)) - start)
    return ids, targets


def warm_start(model_dir: str | Path, task: Task, *, steps: int, batch_size: int = 32, learning_rate: float = 1e-3,
               seed: int = 0, save_dtype: str = "bfloat16") -> float:
    """Train the model in `model_dir` on the task's format examples and save it in place; returns the last loss."""
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    # Under mpiexec torch starts with one thread; the other ranks wait asleep for this model
    # (`sfhpc.runtime.idle_wait`), so its warm start may use every core the process may run on, unless
    # OMP_NUM_THREADS says how many (a machine shared with other work: there more threads than free cores
    # make every small operation wait for a time slice).
    threads = torch.get_num_threads()
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(wanted) if wanted.isdigit() and int(wanted) > 0
                          else max(threads, len(os.sched_getaffinity(0))))
    try:
        return _train(model_dir, task, tokenizer=load_tokenizer(model_dir), rng=rng, steps=steps,
                      batch_size=batch_size, learning_rate=learning_rate, save_dtype=save_dtype)
    finally:
        torch.set_num_threads(threads)


def _train(model_dir: str | Path, task: Task, *, tokenizer: ChatTokenizer, rng: random.Random, steps: int,
           batch_size: int, learning_rate: float, save_dtype: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    loss_value = float("nan")
    for _ in range(steps):
        encoded = [encode_with_targets(c, tokenizer, tools=task.tools)
                   for c in task.warm_start_examples(rng, batch_size)]
        if not encoded or not any(any(targets) for _, targets in encoded):
            return loss_value
        width = max(len(ids) for ids, _ in encoded)
        ids = torch.full((len(encoded), width), tokenizer.pad_id)
        mask = torch.zeros((len(encoded), width), dtype=torch.bool)
        for row, (tokens, targets) in enumerate(encoded):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(targets)] = torch.tensor(targets)
        logits = model(ids).logits[:, :-1]
        # Position t predicts token t+1; a token is a target when it belongs to an assistant reply.
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    model.to(getattr(torch, save_dtype)).save_pretrained(model_dir)
    return loss_value
