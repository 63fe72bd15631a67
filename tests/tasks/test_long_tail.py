"""The long-tailed workloads: the Pareto draw of reply lengths and turn counts, and their verifiable rewards."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from sfhpc.config.recipe import TaskSpec
from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, OpenAIApi
from sfhpc.endpoint.client import AsyncLocalClient
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.errors import ConfigError
from sfhpc.rollout.agent import LocalChat, play_episode
from sfhpc.tasks import get_task
from sfhpc.tasks.long_tail import long_tail_count


def test_the_draw_has_a_pareto_tail_within_its_bounds() -> None:
    rng = random.Random(0)
    draws = [long_tail_count(rng, low=2, high=10_000, alpha=1.0) for _ in range(20_000)]
    assert min(draws) == 2 and max(draws) <= 10_000
    # P(N >= n) = (low / n) ** alpha for the continuous tail; the floor moves it by less than one.
    for n, expected in ((4, 0.5), (20, 0.1), (200, 0.01)):
        share = sum(d >= n for d in draws) / len(draws)
        assert share == pytest.approx(expected, rel=0.15), n
    # Heavy: the mean is far above the median, the batch's longest far above its mean.
    assert statistics.mean(draws) > 3 * statistics.median(draws)
    capped = [long_tail_count(rng, low=1, high=50, alpha=0.5) for _ in range(2000)]
    assert max(capped) == 50 and sum(c == 50 for c in capped) > 100  # the cap holds the mass beyond it
    lighter = [long_tail_count(rng, low=2, high=10_000, alpha=3.0) for _ in range(20_000)]
    assert statistics.mean(lighter) < statistics.mean(draws)


def test_repeat_letter_rewards_the_exact_run_and_partial_lengths() -> None:
    task = get_task(TaskSpec("repeat-letter", {"min_count": 1, "max_count": 40, "letters": "q", "slack": 3}))
    assert task.max_reply_tokens == 43
    problem = task.sample(random.Random(5))
    letter, count = problem.data
    assert letter == "q" and 1 <= count <= 40 and problem.key == f"{count}q"
    episode = task.episode(problem)
    assert episode.opening() == [{"role": "user", "content": f"write {count} q"}]
    assert episode.reply_tokens() == count + 3
    result = episode.step("q" * count)
    assert result.done and result.reward == 1.0
    long = task.episode(task.sample(random.Random(1)))
    n = long.count  # type: ignore[attr-defined]
    assert long.step("q" * (n + max(1, n // 2))).reward == pytest.approx(1 - max(1, n // 2) / n)
    assert long.step(" " + "q" * n + "\n").reward == 1.0
    for wrong in ("", "p" * n, "q" * (n - 1) + "x", "q q"):
        assert long.step(wrong).reward == 0.0, wrong
    assert long.step("q" * (3 * n)).reward == 0.0  # far off: nothing, never negative


def test_repeat_letter_problems_are_long_tailed_and_the_warm_start_teaches_only_the_format() -> None:
    task = get_task(TaskSpec("repeat-letter", {"max_count": 500}))
    rng = random.Random(3)
    counts = [task.sample(rng).data[1] for _ in range(4000)]
    assert statistics.median(counts) <= 3 and max(counts) > 100
    examples = task.warm_start_examples(random.Random(0), 200)
    for ask, reply in examples:
        letter = ask["content"].split()[2]
        assert set(reply["content"]) == {letter}  # the right letter, a long-tailed run of it
    lengths = [len(r["content"]) for _, r in examples]
    assert max(lengths) > 5 * statistics.median(lengths)  # as long-tailed as the problems
    asked = [int(a["content"].split()[1]) for a, _ in examples]
    assert all(a / 2 - 1 <= n <= 1.5 * a + 1 for a, n in zip(asked, lengths))  # the length follows the ask
    longer = [(a, n) for a, n in zip(asked, lengths) if a >= 10]
    assert len(longer) > 10 and sum(a == n for a, n in longer) < len(longer) / 4  # but is rarely the answer


def test_letter_chain_lasts_its_drawn_number_of_turns_and_scores_the_fraction_right() -> None:
    task = get_task(TaskSpec("letter-chain", {"min_turns": 1, "max_turns": 64, "alpha": 0.8}))
    assert task.max_turns == 64 and task.max_reply_tokens == 2
    rng = random.Random(7)
    lengths = [len(task.sample(rng).data) for _ in range(3000)]
    assert min(lengths) == 1 and statistics.median(lengths) <= 3 and max(lengths) == 64
    chain = next(p for p in (task.sample(rng) for _ in range(100)) if len(p.data) == 4)
    episode = task.episode(chain)
    assert episode.opening()[0]["content"] == f"after {chain.data[0]}"
    results = []
    for i, letter in enumerate(chain.data):
        reply = chr(ord(letter) + 1) if i % 2 == 0 else "?"
        results.append(episode.step(reply))
    assert [r.done for r in results] == [False, False, False, True]
    assert [r.observation for r in results[:-1]] == [f"after {c}" for c in chain.data[1:]]
    assert [r.turn_reward for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert results[-1].reward == 0.5
    # Whatever the replies, a chain runs its K turns: the tail is the workload's, not the policy's.
    assert sum(not task.episode(chain).step("x").done for _ in range(3)) == 3


@pytest.mark.parametrize(("name", "options", "fragment"), [
    ("repeat-letter", {"min_count": 0}, "min"),
    ("repeat-letter", {"min_count": 9, "max_count": 3}, "max"),
    ("repeat-letter", {"alpha": 0}, "alpha"),
    ("repeat-letter", {"letters": "A"}, "letters"),
    ("repeat-letter", {"slack": 0}, "slack"),
    ("letter-chain", {"max_turns": 0}, "min"),
    ("letter-chain", {"letters": "z"}, "letters"),
    ("letter-chain", {"turns": 3}, "turns"),
])
def test_bad_options_are_one_config_error(name: str, options: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        get_task(TaskSpec(name, options))


def test_an_agent_replies_within_the_problem_s_own_bound() -> None:
    # An engine that never stops on its own (no end token in its vocabulary) writes each reply to the bound
    # the episode gives, so its replies are exactly as long-tailed as the problems.
    task = get_task(TaskSpec("repeat-letter", {"max_count": 60, "slack": 2}))
    rng = random.Random(11)
    problems = [task.sample(rng) for _ in range(12)]
    manager = TrajectoryManager()
    engine = ScriptedEngine(seed=0, vocab=tuple(range(ord("a"), ord("z") + 1)), max_model_len=256)
    chat = LocalChat(AsyncLocalClient(OpenAIApi(AgentEndpoint(engine, manager), model_name="m")), "m")

    async def play_all() -> list[str]:
        outcomes = [await play_episode(chat, task, p, group=p.key, seed=i, max_tokens=40)
                    for i, p in enumerate(problems)]
        return [o.trajectory_id for o in outcomes]

    ids = asyncio.run(play_all())
    lengths = [sum(manager.trajectory(t).generated_mask()) for t in ids]
    assert lengths == [min(p.data[1] + 2, 40) for p in problems]  # the recipe's max_new_tokens caps it
    assert len(set(lengths)) > 3
