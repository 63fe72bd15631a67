"""Python imports this at start-up in every process of a test run whose PYTHONPATH names this folder
(the sfhpc command, every MPI rank, vLLM's children): it registers ``flaky-letter`` through the task
registry, the way a user's own task would be. It is ``next-letter`` with the faults of real user code:
an episode of letter 'a' cannot even open (before its trajectory exists), one of letter 'b' raises on
the policy's reply (after its first turn)."""

from __future__ import annotations

from sfhpc.tasks.base import Episode, Problem, StepResult, register
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


@register("flaky-letter")
class FlakyLetterTask(NextLetterTask):
    name = "flaky-letter"

    def episode(self, problem: Problem) -> Episode:
        return _FlakyEpisode(super().episode(problem), problem.data)
