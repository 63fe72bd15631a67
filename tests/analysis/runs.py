"""A small run folder for the analysis tests, written by the real trajectory manager and store.

    plain    group g: one reply by version 1                                  consumed at step 0 (version 2)
    cut      group g: one reply, cut by an abort under version 1 and continued by version 2 on another engine
    multi    group h: two replies (an observation between), version 2         consumed at step 1 (version 3)
    failed   group bad: its agent raised
    open     group o: still running (a prompt only)
"""

from __future__ import annotations

import json
from pathlib import Path

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.store import TrajectoryStore
from sfhpc.engine.tokenizer import END, ByteTokenizer

TOKENIZER = ByteTokenizer()
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
PROMPT_TEXT = "<|bos|><|user|>What is 2+3?<|end|><|assistant|>"
IDS = ["plain", "cut", "multi", "failed", "open"]


def reply(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def write_run(folder: Path, *, metrics: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    manager = TrajectoryManager(TrajectoryStore.create(folder / "trajectories.h5"), max_token_lag=4)
    prompt = TOKENIZER.apply_chat_template(QUESTION)

    plain = manager.start(prompt, task="arith", group="g", trajectory_id="plain")
    manager.add_generated(plain, reply("5") + [END], [-0.5, -0.25], 1, engine="rollout-0", finish_reason="stop")
    manager.finish(plain, reward=1.0, turn_rewards=[1.0])

    cut = manager.start(prompt, task="arith", group="g", trajectory_id="cut")
    manager.add_generated(cut, reply("The ans"), [-0.1] * 7, 1, engine="rollout-0", finish_reason="abort")
    manager.interrupt(cut)  # a weight update: the engine paused, the prefix is kept
    manager.continuation(cut, max_new_tokens=32)
    manager.add_generated(cut, reply("wer is 5") + [END], [-0.2] * 9, 2, engine="rollout-1", finish_reason="stop")
    manager.finish(cut, reward=0.5, turn_rewards=[0.5])
    assert manager.take_batch(policy_version=2, num_groups=1) is not None  # step 0: plain, cut

    multi = manager.start(prompt, task="arith", group="h", trajectory_id="multi")
    first = reply("4?") + [END]
    manager.add_generated(multi, first, [-1.0, -1.0, -0.5], 2, engine="rollout-0", finish_reason="stop")
    observation = TOKENIZER.apply_chat_template([*QUESTION, {"role": "assistant", "content": "4?"},
                                                 {"role": "user", "content": "Wrong, try again."}])
    manager.observe(multi, observation)
    manager.add_generated(multi, reply("5") + [END], [-0.3, -0.1], 2, engine="rollout-0", finish_reason="stop")
    manager.finish(multi, reward=0.0, turn_rewards=[0.0, 0.0])
    assert manager.take_batch(policy_version=3, num_groups=1) is not None  # step 1: multi

    failed = manager.start(prompt, task="arith", group="bad", trajectory_id="failed")
    manager.fail(failed, "ValueError: not a digit")
    manager.start(prompt, task="arith", group="o", trajectory_id="open")
    manager.close()
    if metrics:
        rows = [{"step": 0, "version": 2, "reward_mean": 0.75, "trajectories": 2, "loss": 0.5},
                {"step": 1, "version": 3, "reward_mean": 0.0, "trajectories": 1, "loss": 0.25}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder
