"""A user's own task, named in a recipe by its file (``.../flaky_letter.py:FlakyLetterTask``) and imported
from it on every rank that builds the task, as any user code is. It is ``next-letter`` with the faults of
real user code: an episode of letter 'a' cannot even open (before its trajectory exists), one of letter 'b' raises on
the policy's reply (after its first turn)."""

from __future__ import annotations

from sfhpc.tasks.base import Episode, Problem, StepResult
from sfhpc.tasks.letters import NextLetterTask


class _FlakyEpisode(Episode):
    def __init__(self, inner: Episode, letter: str) -> None:
        self.inner, self.letter = inner, letter

    def opening(self) -> list[dict[str, str]]:
        if self.letter == "a":
            raise RuntimeError("no question can be asked about 'a'")
        return self.inner.opening()

    def step(self, reply: str) -> StepResult:
        if self.letter == "b":
            raise ValueError(f"cannot judge the reply {reply!r}")
        return self.inner.step(reply)


class FlakyLetterTask(NextLetterTask):
    name = "flaky-letter"

    def episode(self, problem: Problem) -> Episode:
        return _FlakyEpisode(super().episode(problem), problem.data)
