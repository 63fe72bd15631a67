"""The cluster-scale simulation (`sfhpc.sim`, `sfhpc bench simulate`) and the cost model behind it.

Hand-checkable schedules on a two-GPU cluster with round step costs; the modes compared on a small
long-tailed cluster; the command's files and its one-line errors. (Only compute is modelled: the GPU
cannot exist here. The scheduler is the real one.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sfhpc.config.cluster import ClusterMap, Pool
from sfhpc.errors import SfhpcError
from sfhpc.sim.clock import EventQueue
from sfhpc.sim.cluster import scaled_cluster
from sfhpc.sim.cost_model import CostModel, DeviceCosts
from sfhpc.sim.engine import SimEngine
from sfhpc.sim.pipeline import SimConfig, simulate
from sfhpc.sim.workload import WORKLOADS, Group, Sample, Workload
from tests.conftest import assert_one_line_error, run_sfhpc


def _pool(name: str, tags: tuple[str, ...], gpus: int, gpu_type: str | None, nodes: int = 1) -> Pool:
    return Pool(name, partition=name, nodes=nodes, tags=tags, cpus_per_node=8, memory_mb=1000,
                gpus_per_node=gpus, gpu_type=gpu_type)


def _two_gpu_map(trainer_tags: tuple[str, ...] = ("train", "rollout")) -> ClusterMap:
    return ClusterMap("tiny", (_pool("h100", trainer_tags, 1, "h100"), _pool("l40s", ("rollout",), 1, "l40s")))


# Round costs: an engine makes 100 tokens/s whatever its batch (a step of b sequences takes b * 10 ms),
# a trained token costs 10 ms, the weights take 0.5 s to broadcast, lending and reclaiming take no time.
_DEVICE = DeviceCosts(decode_base_s=0.0, decode_per_sequence_s=0.01, prefill_per_token_s=0.0,
                      train_per_token_s=0.01, max_batch=100, host_gb_s=1e12)
ROUND = CostModel({"h100": _DEVICE, "l40s": _DEVICE}, weight_bytes=0.5e9, sync_gb_s=1.0, engine_fixed_s=0.0)
FIXED = Workload("fixed", group_size=1, prompt_tokens=0, reply_min=100, reply_max=100)  # every reply 100 tokens
SYNC_S = 0.5  # (and 20 us of latency per tree level: within the tolerance)


def _tiny(mode: str, cluster: ClusterMap | None = None, **config: object) -> object:
    settings = {"prompts_per_step": 2, "steps": 3, "warmup_steps": 1, "max_staleness": 0, **config}
    return simulate(scaled_cluster(cluster or _two_gpu_map(), 2), ROUND, SimConfig(mode, FIXED, **settings))


def test_engine_decodes_its_batch_under_processor_sharing() -> None:
    clock = EventQueue()
    ends: list[tuple[float, int]] = []
    engine = SimEngine(0, "l40s", _DEVICE, clock, lambda s, e: ends.append((clock.now, s.id)))
    group = Group(0)
    short, long = Sample(1, group, (100,), prompt=10), Sample(2, group, (300,), prompt=10)
    engine.admit([short, long])
    clock.run()
    # Both at 50 tokens/s (a step of two takes 20 ms): the short one ends at 2 s; alone, the long one
    # makes 100 tokens/s for its last 200 tokens: 4 s.
    assert ends == [(pytest.approx(2.0), 1), (pytest.approx(4.0), 2)]
    assert engine.generating_s == pytest.approx(4.0)


def test_evicted_sequence_keeps_its_tokens_and_continues_from_its_prefix() -> None:
    clock = EventQueue()
    ends: list[float] = []
    first = SimEngine(0, "h100", _DEVICE, clock, lambda s, e: ends.append(clock.now))
    second = SimEngine(1, "l40s", _DEVICE, clock, lambda s, e: ends.append(clock.now))
    sample = Sample(1, Group(0), (100,), prompt=10)
    first.admit([sample])
    clock.at(0.4, lambda _: second.admit(first.evict()))  # reclaimed after 40 tokens
    clock.run()
    assert sample.generated == 40 and sample.remaining == 0.0
    assert ends == [pytest.approx(1.0)]  # 40 tokens, moved, the other 60 at the same rate
    assert first.holds == 0


@pytest.mark.parametrize("cached", [True, False])
def test_a_later_turn_prefills_its_whole_context_without_a_prefix_cache(cached: bool) -> None:
    """A turn after a tool call prefills only the tool's result where the engine kept the context (vLLM's
    prefix caching), else all of it: the prompt, the first reply and the result (the test engine's model)."""
    clock = EventQueue()
    ends: list[float] = []
    engine = SimEngine(0, "l40s", dataclasses.replace(_DEVICE, prefill_per_token_s=0.001), clock,
                       lambda s, e: e.admit([s]) if not s.finish_turn() else ends.append(clock.now))
    engine.admit([Sample(1, Group(0), (100, 100), prompt=10, observation=5, cached=cached)])
    clock.run()
    # 200 tokens at 100 tokens/s, a prompt token prefilled in 1 ms: the prompt's 10, then 5 or 10 + 100 + 5.
    assert ends == [pytest.approx(2.0 + 0.010 + (0.005 if cached else 0.115))]


def test_sync_schedule_computes_to_the_hand_checked_figures() -> None:
    # A step: both engines write their one reply (1 s), the trainer trains on 200 tokens (2 s), the weights
    # go out (0.5 s). The trainer's rank generates or trains or syncs all the time; the rollout rank waits
    # while the trainer trains.
    result = _tiny("sync")
    step = 1.0 + 2.0 + SYNC_S
    assert result.step_s_mean == pytest.approx(step, rel=1e-4)
    assert result.trained_tokens_per_s == pytest.approx(200 / step, rel=1e-4)
    assert result.bubble["rollout"] == pytest.approx(2.0 / step, rel=1e-4)
    assert result.bubble["trainer,rollout"] == pytest.approx(0.0, abs=1e-4)
    assert result.bubble["all"] == pytest.approx(2.0 / (2 * step), rel=1e-4)
    assert result.staleness_max == 0 and result.tokens_discarded == 0 and result.lends == 0


def test_async_and_seamless_schedules_compute_to_the_hand_checked_figures() -> None:
    # async, max_staleness 0: the rollout engine writes both replies at 50 tokens/s each (2 s) while the
    # trainer waits, then trains (2 s) while the engine waits, then both sync.
    result = _tiny("async")
    step = 2.0 + 2.0 + SYNC_S
    assert result.trained_tokens_per_s == pytest.approx(200 / step, rel=1e-4)
    assert result.bubble["trainer"] == pytest.approx(2.0 / step, rel=1e-4)
    assert result.bubble["rollout"] == pytest.approx(2.0 / step, rel=1e-4)
    # seamless: the trainer's rank is lent while it waits and takes one of the two episodes (fewest in flight,
    # ties to the lower rank); both replies are done after 1 s, the rank is reclaimed and trains.
    lent = _tiny("seamless")
    step = 1.0 + 2.0 + SYNC_S
    assert lent.trained_tokens_per_s == pytest.approx(200 / step, rel=1e-4)
    assert lent.bubble["trainer"] == pytest.approx(0.0, abs=1e-4)  # lent with work, training, syncing
    assert lent.bubble["rollout"] == pytest.approx(2.0 / step, rel=1e-4)
    assert (lent.lends, lent.reclaims) == (2, 2)  # once per measured step
    assert lent.trained_tokens_per_s > result.trained_tokens_per_s


def test_staged_updates_keep_the_engines_generating_through_the_transfer() -> None:
    # Training nearly free (0.2 s a step), the rollout engine the bottleneck: 200 tokens a step at 100 tokens/s
    # are 2 s of generation, and the staleness bound lets it run a step ahead. Paused for each transfer, a step
    # lasts 2 s + 0.5 s; staged, the engine generates through the transfer and pauses only for the load (no
    # time here: its decode steps read no weights), so a step lasts the 2 s of generation.
    cheap = dataclasses.replace(_DEVICE, train_per_token_s=0.001)
    cost = dataclasses.replace(ROUND, devices={"h100": cheap, "l40s": cheap})
    results = {staged: simulate(scaled_cluster(_two_gpu_map(), 2), cost,
                                SimConfig("async", FIXED, prompts_per_step=2, steps=12, warmup_steps=2,
                                          max_staleness=1, staged_updates=staged))
               for staged in (False, True)}
    paused, staged = results[False], results[True]
    # Each update cuts the running replies at a token boundary (the decode step under way is lost: 12 ms a step
    # here), and they continue from their prefix.
    assert paused.step_s_mean == pytest.approx(2.0 + SYNC_S, rel=1e-2)
    assert paused.shares["rollout"]["syncing"] == pytest.approx(SYNC_S / (2.0 + SYNC_S), rel=1e-2)
    assert staged.step_s_mean == pytest.approx(2.0, rel=1e-3)
    assert staged.trained_tokens_per_s == pytest.approx(100.0, rel=1e-3)
    assert staged.shares["rollout"]["syncing"] == 0.0
    assert staged.shares["rollout"]["generating"] == pytest.approx(1.0, rel=1e-4)
    # The trainer still waits for the transfer (it sends the version) before the next step's batch.
    assert staged.shares["trainer"]["syncing"] == pytest.approx(SYNC_S / 2.0, rel=1e-3)


def test_seamless_without_lendable_ranks_runs_as_async_and_says_so() -> None:
    unlendable = _two_gpu_map(trainer_tags=("train",))
    seamless, async_ = _tiny("seamless", unlendable), _tiny("async", unlendable)
    assert seamless.lends == 0 and "ran as async" in seamless.note
    assert seamless.trained_tokens_per_s == pytest.approx(async_.trained_tokens_per_s)
    assert seamless.bubble == pytest.approx(async_.bubble)


def test_seamless_lends_reclaims_and_waits_less_than_sync_on_a_long_tail() -> None:
    cluster = scaled_cluster(ClusterMap("site", (_pool("h100", ("train", "rollout"), 8, "h100", nodes=2),
                                                 _pool("l40s", ("rollout",), 4, "l40s", nodes=4))), 32)
    cost = CostModel.published("qwen2.5-7b")
    results = {mode: simulate(cluster, cost, SimConfig(mode, WORKLOADS["long-tail"], prompts_per_step=16, steps=4,
                                                        warmup_steps=1))
               for mode in ("sync", "async", "seamless")}
    seamless, sync = results["seamless"], results["sync"]
    assert seamless.lends >= 16 and seamless.reclaims == seamless.lends  # every trainer GPU, every step
    assert seamless.migrated_samples > 0  # unfinished generations moved at reclaims, continued elsewhere
    assert seamless.reclaim_latency_max_s < 1.0
    per_token = {m: r.waiting_rank_s / r.trained_tokens for m, r in results.items()}
    assert per_token["seamless"] < per_token["async"] < per_token["sync"]
    assert seamless.bubble["all"] < sync.bubble["all"] / 2
    assert seamless.trained_tokens_per_s > results["async"].trained_tokens_per_s > sync.trained_tokens_per_s
    # Nothing is thrown away: the group with a long reply trains when complete, some versions late.
    assert seamless.tokens_discarded == results["async"].tokens_discarded == 0
    assert sync.staleness_max == 0 and seamless.staleness_max > 2  # the default max_staleness is 2
    # Lent ranks run dry before the batch is ready (they get only new episodes): without moving work onto
    # them (the default rebalancing), the trainer's ranks wait more.
    alone = simulate(cluster, cost, SimConfig("seamless", WORKLOADS["long-tail"], prompts_per_step=16,
                                              steps=4, warmup_steps=1, rebalance=False))
    assert alone.bubble["trainer"] > seamless.bubble["trainer"]
    assert alone.migrated_samples < seamless.migrated_samples


def test_tag_map_scales_in_its_proportion_and_refuses_what_it_cannot_simulate() -> None:
    site = ClusterMap("site", (_pool("h100", ("train", "rollout"), 8, "h100", nodes=16),
                               _pool("l40s", ("rollout",), 4, "l40s", nodes=32)))
    big = scaled_cluster(site, 8192)
    assert (big.trainer_gpus, big.rollout_gpus) == (4096, 4096) and big.lending_allowed
    plan = big.plan(colocated=False)
    assert plan.world_size == 8192 and plan.ranks()[0].roles == ("trainer",)
    assert plan.ranks()[-1].roles == ("rollout",) and "rollout" in plan.ranks()[0].tags
    with pytest.raises(SfhpcError, match="needs a pool tagged 'train'"):
        scaled_cluster(ClusterMap("x", (_pool("l40s", ("rollout",), 4, "l40s"),)), 64)
    with pytest.raises(SfhpcError, match="gpu_type 'a100'"):
        scaled_cluster(ClusterMap("x", (_pool("a", ("train",), 8, "a100"), _pool("l", ("rollout",), 4, "l40s"))), 64)


def test_cost_model_from_published_figures_and_calibrated_on_a_run() -> None:
    cost = CostModel.published("qwen2.5-7b")
    h100, l40s = cost.device("h100"), cost.device("l40s")
    assert h100.tokens_per_s(64) > l40s.tokens_per_s(64) > l40s.tokens_per_s(1)  # bandwidth, then batching
    assert 1 < l40s.decode_step_s(1) / h100.decode_step_s(1) < 5  # 3.35 TB/s against 864 GB/s
    assert cost.train_s("h100", 10_000, gpus=2) == pytest.approx(cost.train_s("h100", 10_000) / 2)
    # A staged version's load: the weights read and written once in device memory, 46 ms on an L40S for a 7B, 3%
    # of its broadcast over the rollout nodes' 100 Gb/s link.
    load = cost.staged_load_s("l40s")
    assert load == pytest.approx(2 * l40s.decode_base_s) and 0.02 < load / cost.weight_sync_s(12) < 0.04
    rows = [{"trained_tokens": 999, "train_s": 9.0, "generated_tokens": 1, "step_s": 99.0, "sync_s": 9.0},  # warm-up
            {"trained_tokens": 1000, "train_s": 2.0, "generated_tokens": 400, "step_s": 4.0, "sync_s": 0.5},
            {"trained_tokens": 1000, "train_s": 2.0, "generated_tokens": 400, "step_s": 4.0, "sync_s": 0.5}]
    measured = CostModel.calibrated_from(rows, trainer_gpus=2, rollout_engines=2, concurrency=10, weight_bytes=1e9)
    cpu = measured.device("cpu")
    assert cpu.train_per_token_s == pytest.approx(2 * 4.0 / 2000)     # 500 trained tokens/s on 2 ranks
    assert cpu.tokens_per_s(10) == pytest.approx(400 * 2 / 8.0 / 2)   # 100 generated tokens/s per engine
    assert measured.weight_sync_s() == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(SfhpcError, match="after the first"):
        CostModel.calibrated_from(rows[:1], trainer_gpus=1, rollout_engines=1, concurrency=1, weight_bytes=1.0)


def test_bench_simulate_writes_table_json_and_chart(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    done = run_sfhpc("bench", "simulate", "--sizes", "16,32", "--steps", "3", "--warmup-steps", "1",
                     "--samples-per-gpu", "4", "--out", str(out), "--jobs", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compute is modelled" in done.stdout
    data = json.loads((out / "simulate.json").read_text())
    runs = {(r["workload"], r["gpus"], r["mode"]) for r in data["results"]}
    assert runs == {(w, g, m) for w, sizes in (("long-tail", (16, 32)), ("multi-turn", (16,)))
                    for g in sizes for m in ("sync", "async", "seamless")}
    seamless = next(r for r in data["results"] if r["mode"] == "seamless" and r["gpus"] == 32)
    assert seamless["lends"] > 0 and seamless["vs_sync"] > 1 and 0 <= seamless["bubble"]["all"] < 1
    table = (out / "simulate.txt").read_text()
    assert "trained tok/s" in table and "seamless, long-tail, 32 GPUs: bubble" in table
    assert (out / "simulate.png").read_bytes()[:4] == b"\x89PNG"
    # A trace per mode at the smallest size: a track per rank, states as a run's trace names them.
    for mode in ("sync", "async", "seamless"):
        trace = json.loads((out / f"simulate-{mode}.trace.json").read_text())["traceEvents"]
        spans = [e for e in trace if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == set(range(16)), mode  # 16 GPUs, each a rank of the scaled plan
        assert all({"name", "ph", "ts", "pid", "tid"} <= set(e) for e in trace) and all(e["dur"] >= 0 for e in spans)
        states = {e["name"] for e in spans}
        assert {"training", "generating", "syncing"} <= states and ("lent" in states) == (mode == "seamless")


def test_bench_simulate_bad_tag_map_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "map.yaml"
    bad.write_text("cluster: x\npools:\n  l40s:\n    partition: inference\n    nodes: 2\n    tags: [rollout]\n"
                   "    cpus_per_node: 8\n    gpus_per_node: 4\n    gpu_type: l40s\n    memory_mb: 1000\n")
    done = run_sfhpc("bench", "simulate", "--cluster", str(bad), "--out", str(tmp_path / "out"))
    assert_one_line_error(done, str(bad), "needs a pool tagged 'train'")
    assert not (tmp_path / "out").exists()


def test_a_simulation_is_reproducible_with_multi_turn_episodes_moved_at_reclaims() -> None:
    cluster = scaled_cluster(ClusterMap("site", (_pool("h100", ("train", "rollout"), 8, "h100", nodes=1),
                                                 _pool("l40s", ("rollout",), 4, "l40s", nodes=2))), 16)
    config = SimConfig("seamless", WORKLOADS["multi-turn"], prompts_per_step=8, steps=4, warmup_steps=1, seed=3)
    first, second = (simulate(cluster, CostModel.published(), config) for _ in range(2))
    assert first.migrated_samples > 0
    assert first.as_json() == second.as_json()
