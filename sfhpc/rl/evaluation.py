"""Evaluation during training: held-out problems played on the rollout engines, never trained on.

`Evaluation` owns what an evaluation is: its problems (the recipe's ``evaluation`` section, read once through
`Task.evaluation_problems`, the same at every evaluation of the run), when one is due (before the first step,
every ``evaluation.every`` steps and after the last), the tickets of one (a group per problem of ``samples``
episodes, keys beginning ``eval-``: `sfhpc.data.groups.is_evaluation`), and its scores.

The controller hands the tickets out like any episodes, to the rollout ranks and, in ``seamless``, to trainer
ranks lent to rollout, and waits for their ends (`TrajectoryManager.take_evaluation`) before the step's
metrics row is written. The loop is held there, so no weight update comes between: every evaluation token
is of the version evaluated. Agent programs play evaluation episodes as they play any. The endpoint lets
their turns sample as the section says, greedy included (`SamplingRule`). The store keeps their trajectories
with the status ``evaluated`` (or ``failed``), never in a batch.

Scores, over the problems, with k = ``samples`` replies each and a reply passing when its reward is at least
``pass_reward``:

- ``pass@1``: the mean over problems of the share of its replies that pass. This is the unbiased estimate
  of one reply's chance (Chen et al., 2021, with n = k).
- ``mean@k``: the mean reward of every reply.
- ``pass@k``: the share of problems with at least one passing reply.

A failed episode (its agent raised or timed out) is a reply of reward 0 that does not pass, and is counted in
``eval_failed``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from pathlib import Path

from sfhpc.config.recipe import EvaluationSpec
from sfhpc.data.groups import EVALUATION_PREFIX
from sfhpc.rl.messages import EpisodeTicket
from sfhpc.tasks.base import Problem, Task

Ended = Mapping[str, Mapping[str, float | None]]  # group -> episode -> reward (None: failed)


@dataclasses.dataclass(frozen=True)
class EvaluationScore:
    """One evaluation: the policy `version` after training step `step` (0: before training)."""

    step: int
    version: int
    problems: int
    samples: int
    pass_at_1: float
    mean_at_k: float
    pass_at_k: float
    failed: int
    seconds: float

    def metrics(self) -> dict[str, float | int]:
        """Its fields in a ``metrics.jsonl`` row (``eval_`` keys; the same names whatever k is)."""
        return {"eval_version": self.version, "eval_problems": self.problems, "eval_k": self.samples,
                "eval_pass_at_1": self.pass_at_1, "eval_mean_at_k": self.mean_at_k, "eval_pass_at_k": self.pass_at_k,
                "eval_failed": self.failed, "eval_s": round(self.seconds, 3)}

    def line(self) -> str:
        """One console line."""
        k = self.samples
        failed = f", {self.failed} failed" if self.failed else ""
        at_k = f"  mean@{k} {self.mean_at_k:.3f}  pass@{k} {self.pass_at_k:.3f}" if k > 1 else \
            f"  mean reward {self.mean_at_k:.3f}"
        return (f"evaluation of version {self.version} ({self.problems} problems x {k}{failed}): "
                f"pass@1 {self.pass_at_1:.3f}{at_k}  [{self.seconds:.1f} s]")


def score(ended: Ended, *, pass_reward: float) -> tuple[float, float, float, int]:
    """(pass@1, mean@k, pass@k, failed episodes) of the `ended` episodes of each problem's group (see the
    module docstring)."""
    shares, rewards, any_pass, failed = [], [], [], 0
    for episodes in ended.values():
        values = [0.0 if r is None else r for r in episodes.values()]
        failed += sum(r is None for r in episodes.values())
        passed = [r is not None and r >= pass_reward for r in episodes.values()]
        shares.append(sum(passed) / len(passed))
        rewards += values
        any_pass.append(any(passed))
    if not shares:
        return 0.0, 0.0, 0.0, failed
    return sum(shares) / len(shares), sum(rewards) / len(rewards), sum(any_pass) / len(any_pass), failed


class Evaluation:
    """A run's evaluations (see the module docstring)."""

    def __init__(self, spec: EvaluationSpec, task: Task, *, source: str, seed: int, last_step: int) -> None:
        self.spec, self.seed, self.last_step = spec, seed, last_step
        self.problems: list[Problem] = task.evaluation_problems(Path(spec.path) if spec.path else None,
                                                                spec.problems, seed, source=source)

    def due(self, step: int) -> bool:
        """Whether the policy after training step `step` is evaluated (0: the initial policy)."""
        if step == 0:
            return self.spec.before_training
        return step % self.spec.every == 0 or step == self.last_step

    def tickets(self, session: int, step: int) -> tuple[list[EpisodeTicket], list[str]]:
        """The episodes of the evaluation after step `step`, and their groups (one per problem). Keys carry the
        store's writer session, as training groups' do, so an allocation never reuses one."""
        rng = random.Random(f"{self.seed}-evaluation-{step}")  # the training draws stay as they were
        groups = [f"{EVALUATION_PREFIX}s{session}-t{step}-p{index}" for index in range(len(self.problems))]
        tickets = [EpisodeTicket(problem, group, rng.randrange(2**31))
                   for problem, group in zip(self.problems, groups) for _ in range(self.spec.samples)]
        return tickets, groups

    def score(self, step: int, version: int, ended: Ended, seconds: float) -> EvaluationScore:
        pass_at_1, mean_at_k, pass_at_k, failed = score(ended, pass_reward=self.spec.pass_reward)
        return EvaluationScore(step, version, len(ended), self.spec.samples, pass_at_1, mean_at_k, pass_at_k,
                               failed, seconds)

    def describe(self) -> str:
        """The console line at a run's start."""
        spec = self.spec
        where = spec.path or "drawn with a seed of their own"
        sampling = "greedy" if spec.temperature == 0 else f"temperature {spec.temperature:g}"
        first = "before training, then " if spec.before_training else ""
        when = ("the initial policy only (budgets.steps: 0)" if self.last_step == 0
                else f"{first}every {spec.every} steps and after the last")
        return (f"evaluation: {len(self.problems)} problems ({where}) x {spec.samples}, {sampling}, {when}; "
                "never trained on")

