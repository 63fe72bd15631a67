"""A teacher rank (``algorithm.distill``): loads the teacher once and scores the rows the controller sends.

The teacher's folder is the one `sfhpc.rl.program.prepare_teacher` gave every rank. Each teacher rank checks,
before the first step, that the teacher speaks the policy's tokenizer: a run whose teacher reads token ids as
other text would train on noise, so it stops with one line instead.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from sfhpc.config.recipe import Recipe
from sfhpc.errors import SfhpcError
from sfhpc.rl import messages as msg

log = logging.getLogger("sfhpc")


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
