"""The timing scale's configuration as the simulator's (`sfhpc.bench.crosscheck`): the same ranks, costs and
workload, and the comparison's arithmetic. The invocation that runs both is in `test_pipeline_bench.py`."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from sfhpc.bench import crosscheck, timing_agent
from sfhpc.bench.pipeline import TIMING_WORKLOADS, timing_costs, timing_recipe
from sfhpc.sim.pipeline import SimResult
from sfhpc.sim.workload import Group
from sfhpc.tasks.long_tail import RepeatLetterTask


@pytest.mark.parametrize("name", sorted(n for n, w in TIMING_WORKLOADS.items() if not w.agent_turns))
def test_the_simulated_workload_is_the_timing_tasks(name: str) -> None:
    shape = TIMING_WORKLOADS[name]
    recipe = timing_recipe(16, timing_costs(None), model_path=None, workload=name)
    assert recipe["budgets"]["prompts_per_step"] == shape.prompts_per_step(12)  # 12 rollout ranks of 16
    workload = crosscheck.timing_workload(recipe, crosscheck.EpisodeShape(17))
    assert (workload.group_size, workload.prompt_tokens) == (shape.group_size, 17)
    size = shape.group_size
    lengths = workload.replies(np.random.default_rng(0), size * 5000)
    # One length per group (the test engine writes each reply of a problem to the same budget) ...
    assert all(len({lengths[g * size + k] for k in range(size)}) == 1 for g in range(5000))
    # ... drawn as repeat-letter draws its counts, plus the task's slack, within the reply budget.
    task = RepeatLetterTask(**recipe["task"]["options"])
    rng = random.Random(0)
    asked = [task.episode(task.sample(rng)).reply_tokens() for _ in range(5000)]
    drawn = [n for (n,) in lengths[::size]]
    assert min(drawn) == min(asked) == shape.min_count + 2
    assert max(drawn) == max(asked) == recipe["budgets"]["max_new_tokens"] == shape.max_count + 2
    assert statistics.mean(drawn) == pytest.approx(statistics.mean(asked), rel=0.08)
    median = statistics.median(asked)  # 5,000 draws: within a token or two of the tail's (4 and 114 tokens)
    assert statistics.median(drawn) == pytest.approx(median, abs=max(1.0, 0.05 * median))


def test_the_simulated_agent_workload_is_the_timing_agent_programs() -> None:
    """Three calls an episode, each reply drawn for itself as the benchmark's agent program draws it, the
    tool results and the program's turnaround between them as measured, every call prefilling its whole
    context (the test engine keeps nothing between requests)."""
    shape = TIMING_WORKLOADS["agent"]
    recipe = timing_recipe(16, timing_costs(None), model_path=None, workload="agent")
    measured = crosscheck.EpisodeShape(prompt_tokens=10, observation_tokens=18, turnaround_s=0.005)
    workload = crosscheck.timing_workload(recipe, measured, turns=shape.agent_turns)
    assert (workload.group_size, workload.prompt_tokens, workload.observation_tokens) == (8, 10, 18)
    assert workload.env_s == 0.005 and not workload.prefix_cache
    replies = workload.replies(np.random.default_rng(0), 8 * 2000)
    assert {len(r) for r in replies} == {shape.agent_turns}
    assert len({r[0] for r in replies[:8]}) > 1  # the program draws each episode's replies, not the group's
    drawn = [n for r in replies for n in r]
    rng = random.Random(0)
    asked = [timing_agent.reply_tokens(rng, shape.min_count, shape.max_count, shape.alpha) for _ in drawn]
    assert min(drawn) == min(asked) == shape.min_count and max(drawn) == max(asked) == shape.max_count
    assert statistics.mean(drawn) == pytest.approx(statistics.mean(asked), rel=0.05)
    assert statistics.median(drawn) == pytest.approx(statistics.median(asked), abs=2)
    # An episode trains on its prompt, its replies and the tool results between them.
    group = Group(0)
    sample = workload.sample(0, group, (40, 50, 60))
    assert sample.trained_tokens == 10 + 150 + 2 * 18


@pytest.mark.parametrize("name", sorted(TIMING_WORKLOADS))
def test_the_simulated_cluster_and_costs_are_the_timing_scales(name: str) -> None:
    costs = timing_costs(None)
    recipe = timing_recipe(16, costs, model_path=None, speedup=3.0, workload=name)
    cluster = crosscheck.timing_cluster(recipe)
    assert (cluster.trainer_gpus, cluster.rollout_gpus) == (3, 12)  # the controller's rank holds no GPU
    assert cluster.lending_allowed
    weight = TIMING_WORKLOADS[name].batch_weight
    fast = crosscheck.timing_cost_model(costs, 3.0, weight)
    gpu = fast.device("gpu")
    assert gpu.decode_step_s(8) == pytest.approx(recipe["engine"]["token_delay_s"]
                                                 + 8 * recipe["timing_model"]["per_sequence_s"], rel=1e-3)
    assert gpu.train_per_token_s == pytest.approx(recipe["timing_model"]["train_per_token_s"], rel=1e-3)
    assert gpu.prefill_per_token_s == pytest.approx(recipe["timing_model"]["prefill_per_token_s"], rel=1e-3)
    # A played sequence costs its share of `weight` modelled ones; the fixed part of a decode step and the
    # weights' transfer are the model's alone.
    published = costs.device("gpu")
    assert recipe["timing_model"]["per_sequence_s"] == pytest.approx(published.decode_per_sequence_s * weight / 3,
                                                                     rel=1e-3)
    assert recipe["engine"]["token_delay_s"] == pytest.approx(published.decode_base_s / 3, rel=1e-3)
    assert fast.weight_sync_s(12) == pytest.approx(recipe["timing_model"]["weight_transfer_s"], rel=1e-2)
    assert fast.staged_load_s("gpu") == pytest.approx(recipe["timing_model"]["weight_load_s"], rel=1e-2)
    assert recipe["engine"]["staged_updates"]  # the timing scale's default, simulated alike
    assert timing_recipe(16, costs, model_path=None, speedup=3.0, staged=False)["timing_model"]["weight_load_s"] == 0
    assert fast.lend_s("gpu", 3) == 0 and fast.reclaim_s("gpu", 3) == 0  # the timing scale lends for free


def test_the_comparison_is_the_controllers_throughput_over_the_simulators() -> None:
    costs = timing_costs(None)
    recipe = timing_recipe(8, costs, model_path=None, speedup=3.0)
    simulated = crosscheck.simulate_modes(recipe, costs, 3.0, ["async", "seamless"], steps=4,
                                          shape=crosscheck.EpisodeShape(17))
    assert all(isinstance(r, SimResult) and r.trained_tokens_per_s > 0 for r in simulated.values())
    timeline = [{"role": "rollout", "state": "syncing", "t_start": 0.0, "t_end": 1.0},
                {"role": "rollout", "state": "generating", "t_start": 1.0, "t_end": 4.0},
                {"role": "trainer", "state": "syncing", "t_start": 0.0, "t_end": 4.0}]
    timing = [{"mode": mode, "available": True, "bubble": {"overall": 0.1}, "timeline": timeline,
               "trained_tokens_per_s": simulated[mode].trained_tokens_per_s * factor}
              for mode, factor in (("async", 0.9), ("seamless", 0.5))]
    rows = {r.mode: r for r in crosscheck.compare(timing, simulated)}
    assert rows["async"].ratio == pytest.approx(0.9) and rows["async"].within
    assert rows["seamless"].ratio == pytest.approx(0.5) and not rows["seamless"].within
    assert rows["async"].timing_pause_share == pytest.approx(0.25)  # rollout ranks' syncing seconds only
    text = crosscheck.format_comparison(list(rows.values()))
    assert "NO" in text and "0.50" in text
