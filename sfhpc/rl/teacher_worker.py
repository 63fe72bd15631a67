"""A teacher rank (``algorithm.distill``): loads the teacher once and scores the rows the controller sends.

The teacher's folder is the recipe's ``algorithm.distill.teacher``: a Hugging Face folder as it is, or a run
folder (its newest checkpoint) or one of its checkpoints, which rank 0 exports into the run folder before
any rank starts (`prepare_teacher`), in float32 as `model.init_from` does. Each teacher rank checks, before
the first step, that the teacher speaks the policy's tokenizer: a run whose teacher reads token ids as other
text would train on noise, so it stops with one line instead.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import Recipe
from sfhpc.errors import SfhpcError
from sfhpc.rl import messages as msg
from sfhpc.rundir import RunPaths
from sfhpc.runtime.idle_wait import bcast_when_ready

log = logging.getLogger("sfhpc")


def teacher_source(recipe: Recipe) -> Path | None:
    """The folder ``algorithm.distill.teacher`` names (None without distillation)."""
    distill = recipe.algorithm.distill
    return None if distill is None else Path(distill.teacher)


def teacher_problem(recipe: Recipe) -> str | None:
    """What in ``algorithm.distill.teacher`` would stop the run once its ranks started (a missing folder, a run
    folder without a checkpoint), as one line; None when the teacher can be loaded."""
    from sfhpc.rl.export import ExportError, find_checkpoint, split_checkpoint_path

    source = teacher_source(recipe)
    if source is None:
        return None
    where = f"{recipe.source}: algorithm.distill.teacher"
    if (source / "config.json").is_file():
        return None
    if not source.exists():
        return f"{where}: {source} does not exist; name the teacher's Hugging Face folder or a run folder"
    try:
        find_checkpoint(*split_checkpoint_path(source))
    except ExportError as exc:
        return f"{where}: {source} is no Hugging Face folder (no config.json) and no run to take a policy from: {exc}"
    return None


def prepare_teacher(recipe: Recipe, run_dir: Path, world: Any) -> Path | None:
    """The teacher's Hugging Face folder, every rank told (collective): the recipe's folder as it is, or the
    policy of the run it names exported into the run folder by rank 0 (once: a restarted job keeps it)."""
    source = teacher_source(recipe)
    if source is None:
        return None
    path = source
    if world.Get_rank() == 0 and not (source / "config.json").is_file():
        from sfhpc.rl.export import export, split_checkpoint_path

        path = RunPaths(run_dir).teacher
        if not (path / "config.json").is_file():
            run, step = split_checkpoint_path(source)
            export(run, path, step=step, dtype="float32")
            print(f"teacher: the policy of {source} exported to {path}", flush=True)
    return Path(bcast_when_ready(world, str(path)))


class TeacherWorker:
    """Scores rows for the controller (`msg.Score` -> `msg.Scored`)."""

    def __init__(self, recipe: Recipe, teacher_dir: Path, policy_dir: Path, rank: int) -> None:
        import torch

        from sfhpc.trainer.teacher import TeacherScorer, tokenizer_mismatch

        mismatch = tokenizer_mismatch(teacher_dir, policy_dir)
        if mismatch is not None:
            raise SfhpcError(f"{recipe.source}: algorithm.distill.teacher: {teacher_dir} does not speak the policy's "
                             f"tokenizer ({mismatch}); distil from a teacher of the same tokenizer")
        self.rank = rank
        device = "cuda" if torch.cuda.is_available() else "cpu"
        training = recipe.training
        self.scorer = TeacherScorer(teacher_dir, device=device, chunk_tokens=training.logprob_chunk_tokens,
                                    micro_batch_tokens=training.micro_batch_tokens)
        log.info("teacher %s: %d parameters on %s, loaded in %.1f s", teacher_dir, self.scorer.parameters, device,
                 self.scorer.load_seconds)

    def score(self, command: msg.Score) -> msg.Scored:
        started = time.perf_counter()
        logprobs = self.scorer.score(command.batch)
        return msg.Scored(self.rank, logprobs, time.perf_counter() - started)
