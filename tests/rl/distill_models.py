"""A student and a teacher for distillation tests, built here in about a minute: a 2-layer tiny model
warm-started on arith-word's reply format (the student: the right result about 1 time in 4 on two first
numbers), and a 4-layer one warm-started on the *right* worked solutions of the same rows (the teacher). Both
tokenizers are trained on the same texts, so they are the same (the teacher rank checks it)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from sfhpc.config import load_recipe
from sfhpc.model.tiny import build_tiny_model
from sfhpc.model.warm_start import warm_start
from sfhpc.tasks import get_task
from tests.conftest import ROOT

STUDENT_LAYERS, STUDENT_WARM_START = 2, 100
TEACHER_LAYERS, TEACHER_STEPS = 4, 200


def arith_sums(out: Path) -> Path:
    """arith-word's generator on two first numbers (sums 2 + b and 7 + b): a task a tiny model can learn in
    minutes. Returns the training file."""
    subprocess.run([sys.executable, str(ROOT / "data" / "arith-word" / "generate.py"), "--out", str(out),
                    "--train", "400", "--test", "50", "--first", "2", "7"], check=True, capture_output=True)
    return out / "train.jsonl"


def task_yaml(train: Path) -> str:
    return (f"task:\n  name: dataset\n  options: {{path: {train}, prompt: question, answer: answer, reward: numeric, "
            "max_reply_tokens: 10, warm_start: worked}\n")


class Solved:
    """The task with warm-start replies that are right: each row's own worked solution."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, str]]]:
        examples = []
        for _ in range(count):
            messages, answer, _ = self.task.rows[rng.randrange(len(self.task.rows))]
            examples.append([*messages, {"role": "assistant", "content": str(answer).partition("####")[0].rstrip()}])
        return examples

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)


def build_pair(tmp_path: Path, seed: int = 0) -> tuple[Path, Path, Path]:
    """(training file, student folder, teacher folder): a 2-layer student warm-started on the reply format and a
    4-layer teacher warm-started on the right solutions, built from the same texts (so the same tokenizer)."""
    train = arith_sums(tmp_path / "data")
    folders = []
    for name, layers, steps, solved in (("student", STUDENT_LAYERS, STUDENT_WARM_START, False),
                                        ("teacher", TEACHER_LAYERS, TEACHER_STEPS, True)):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"name: {name}\nseed: {seed}\nmodel: {{build: {{layers: {layers}}}}}\n" + task_yaml(train)
                          + "roles: {controller: {place_with: trainer}, trainer: {tags: [train]}, "
                            "rollout: {tags: [rollout]}}\n")
        spec = load_recipe(recipe)
        task = get_task(spec.task, spec.source)
        folder = tmp_path / name
        build_tiny_model(spec.model, folder, seed=seed, task=task)
        warm_start(folder, Solved(task) if solved else task, steps=steps, learning_rate=1e-3, seed=seed)
        folders.append(folder)
    return train, folders[0], folders[1]
