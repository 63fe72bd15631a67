"""The pipeline benchmark: the recipes it derives per mode on the same ranks, the figures it computes, and
one real invocation at the timing scale (mpiexec, the real scheduler, manager, store and agents; engines
and trainer are timing models) that writes its table, JSON and a timeline chart for every mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sfhpc.bench.pipeline import (
    DEFAULT_SPEEDUP,
    DEFAULT_WORKLOAD,
    TIMING_WORKLOADS,
    after_first_step,
    discarded_tokens,
    recipe_for_mode,
    summarize,
    timing_costs,
    timing_recipe,
)
from sfhpc.config import load_recipe
from sfhpc.errors import SfhpcError
from sfhpc.plan.local_map import local_cluster_map
from sfhpc.plan.resolve import resolve
from sfhpc.sim.cost_model import CostModel
from tests.conftest import ROOT, assert_one_line_error, run_sfhpc


def _resolved(data: dict, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(str(path))
    return recipe, resolve(recipe, local_cluster_map(recipe))


def test_every_mode_runs_the_same_workload_on_the_same_ranks(tmp_path: Path) -> None:
    base = yaml.safe_load((ROOT / "recipes" / "bench-pipeline.yaml").read_text())
    base["roles"]["rollout"]["tasks_per_node"] = 3
    as_loaded = json.loads(json.dumps(base))
    plans = {}
    for mode in ("sync", "async", "seamless", "colocated"):
        data = recipe_for_mode(base, "sync" if mode == "colocated" else mode, 7, tmp_path / "out",
                               sync_layout="colocated" if mode == "colocated" else "disaggregated")
        recipe, plan = _resolved(data, tmp_path)
        if mode == "colocated":
            plans[mode] = plan
            continue
        assert recipe.pipeline.mode == mode and recipe.budgets.steps == 7 and recipe.budgets.wall_minutes is None
        assert recipe.name == f"bench-pipeline-{mode}" and recipe.output_dir == str(tmp_path / "out")
        assert recipe.task.name == "repeat-letter" and recipe.algorithm.group_size == 4  # the same learning
        plans[mode] = plan
    assert {p.world_size for p in plans.values()} == {5}  # controller + 1 trainer + 3 rollout, in every mode
    # async and sync: rollout on ranks of its own; seamless: the same, the trainer's node tagged rollout
    # (lendable); colocated sync: every one of those ranks trains and generates.
    for mode in ("sync", "async", "seamless"):
        assert [sorted(c.roles) for c in plans[mode].components] == [["controller", "trainer"], ["rollout"]]
    assert [sorted(c.roles) for c in plans["colocated"].components] == [["controller", "rollout", "trainer"]]
    sync_ranks = [s for s in plans["colocated"].ranks() if "trainer" in s.roles]
    assert len(sync_ranks) == 4 and all("rollout" in s.roles for s in sync_ranks)
    seamless = recipe_for_mode(base, "seamless", 7, tmp_path)
    assert "rollout" in seamless["roles"]["trainer"]["tags"]
    assert base == as_loaded  # the loaded data is left as it was
    with pytest.raises(SfhpcError, match="disaggregated"):
        recipe_for_mode(recipe_for_mode(base, "sync", 3, tmp_path, "colocated"), "async", 3, tmp_path)


def test_the_timing_scale_takes_its_costs_from_the_cost_model(tmp_path: Path) -> None:
    rows = [{"trained_tokens": 1000, "train_s": 2.0, "generated_tokens": 300, "step_s": 3.0, "sync_s": 0.1}] * 4
    costs = timing_costs({"rows": rows, "trainers": 1, "engines": 2, "concurrency": 8, "weight_bytes": 2e7})
    device = costs.device("cpu")
    assert device.train_per_token_s == pytest.approx(2.0 / 1000)
    assert device.tokens_per_s(8) == pytest.approx(300 / 3.0 / 2)  # one engine's decode rate, as measured
    recipe, plan = _resolved(timing_recipe(32, costs, model_path=None), tmp_path)
    assert plan.world_size == 32
    assert (recipe.engine.name, recipe.engine.writes_to_budget, recipe.training.backend) == ("test", True, "timing")
    assert recipe.engine.token_delay_s == pytest.approx(device.decode_base_s, rel=1e-3)
    weight = TIMING_WORKLOADS[DEFAULT_WORKLOAD].batch_weight  # each played reply costs that many of the batch
    assert recipe.timing_model.per_sequence_s == pytest.approx(device.decode_per_sequence_s * weight, rel=1e-3)
    assert recipe.timing_model.train_per_token_s == pytest.approx(device.train_per_token_s * weight, rel=1e-3)
    assert sum("trainer" in s.roles for s in plan.ranks()) == 7 and recipe.task.name == "repeat-letter"
    half = timing_recipe(32, costs, model_path=None, trainer_share=0.5)["roles"]  # 15 of the 31 ranks train
    assert (half["trainer"]["tasks_per_node"], half["rollout"]["tasks_per_node"]) == (15, 16)
    # The agent workload: its own multi-turn program plays the episodes, with room for three replies a context.
    agent, _ = _resolved(timing_recipe(32, costs, model_path=None, workload="agent"), tmp_path)
    assert agent.agent is not None and agent.agent.serve and agent.agent.command[-4:] == ("3", "32", "1024", "0.8")
    assert Path(agent.agent.command[1]).name == "timing_agent.py" and agent.model.max_seq_len >= 3 * 1024
    published = timing_costs(None)
    assert "published" in published.source and set(published.devices) == {"gpu"}
    assert published.device("gpu").train_per_token_s == CostModel.published().device("h100").train_per_token_s


def test_throughput_staleness_and_reclaims_leave_the_first_step_out() -> None:
    def row(step: int, step_s: float, train_s: float, sync_s: float, reward: float, **extra: float) -> dict:
        return {"step": step, "step_s": step_s, "train_s": train_s, "sync_s": sync_s, "trained_tokens": 1000,
                "generated_tokens": 100 * step, "reward_mean": reward, "max_staleness": step % 2,
                "mean_staleness": 0.5 * (step - 1), **extra}

    rows = [row(1, 30.0, 1.0, 1.0, 0.0), row(2, 2.0, 1.0, 0.5, 0.2, reclaim_s=0.25, lends=1, reclaims=1),
            row(3, 2.0, 1.0, 0.1, 0.4, reclaim_s=0.75, lends=2, reclaims=2)]
    got = summarize(rows)
    assert got["steps"] == 2 and got["step_seconds"] == 4.0
    assert got["trained_tokens_per_s"] == 500.0 and got["generated_tokens_per_s"] == 125.0
    assert got["train_share"] == 0.5 and got["sync_share"] == pytest.approx(0.15)
    assert got["wait_share"] == pytest.approx(0.35)
    assert got["mean_staleness"] == pytest.approx((200 * 0.5 + 300 * 1.0) / 500)  # weighted by generated tokens
    assert (got["reward_first"], got["reward_last"], got["max_staleness"]) == (0.0, 0.4, 1)
    assert (got["lends"], got["reclaims"]) == (2, 2)
    assert got["reclaim_latency_mean_s"] == 0.5 and got["reclaim_latency_max_s"] == 0.75
    assert summarize(rows[:2] + [row(3, 2.0, 1.0, 0.1, 0.4)])["lends"] == 0  # no lending columns: none


def test_discarded_tokens_are_whole_dropped_trajectories_and_cuts_off_the_branch() -> None:
    statuses = ["consumed", "stale", "finished", "failed"]
    generated = [10, 7, 5, 3]
    # consumed: a cut of 4 tokens that was continued (on the branch) and one of 2 that was not (off it).
    kinds = ["prompt", "generated", "generated", "generated", "generated", "generated", "generated"]
    tokens = [5, 4, 6, 2, 7, 5, 3]
    used = [5, 4, 6, 0, 7, 5, 3]
    dropped = [False, False, False, False, True, False, True]
    assert discarded_tokens(statuses, generated, kinds, tokens, used, dropped) == 7 + 3 + 2
    assert discarded_tokens(["consumed"], [6], ["generated"], [6], [6], [False]) == 0


def test_the_timeline_leaves_the_start_up_out() -> None:
    rows = [{"rank": 2, "role": "rollout", "state": "generating", "t_start": 0.0, "t_end": 50.0},
            {"rank": 1, "role": "trainer", "state": "waiting", "t_start": 0.0, "t_end": 50.0},
            {"rank": 1, "role": "trainer", "state": "training", "t_start": 50.0, "t_end": 51.0},
            {"rank": 2, "role": "rollout", "state": "waiting", "t_start": 50.0, "t_end": 52.0},
            {"rank": 1, "role": "trainer", "state": "training", "t_start": 53.0, "t_end": 54.0}]
    kept = after_first_step(rows)
    assert [(r["state"], r["t_start"], r["t_end"]) for r in kept] == [
        ("waiting", 51.0, 52.0), ("training", 53.0, 54.0)]


def test_bad_options_get_one_line() -> None:
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--modes", "fast"), "--modes", "fast")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--scales", "huge"), "--scales", "huge")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--ranks", "2"), "--ranks")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--timing-trainer-share", "1"), "--timing-trainer-share")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--calibrate-from", "/nonexistent"), "--calibrate-from")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--scales", "timing", "--calibrate"), "--calibrate", "small")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--scales", "small", "--recipe", "nope.yaml"), "nope.yaml")
    assert_one_line_error(run_sfhpc("bench", "pipeline", "--scales", "small", "--against-simulator"),
                          "--against-simulator", "timing")


@pytest.mark.mpi
def test_one_invocation_runs_every_mode_at_the_timing_scale(tmp_path: Path) -> None:
    out = tmp_path / "bench" / "pipeline.json"
    # The fewest ranks the timing scale takes (a controller, a trainer, two rollout ranks) and two steps measured
    # after the first: each mode's run is mostly its ranks' start-up, and the modelled long tail shows at once.
    # The short workload: a step of grpo-7b's shape lasts tens of seconds (`test_crosscheck.py` checks its shape).
    done = run_sfhpc("bench", "pipeline", "--scales", "timing", "--ranks", "4", "--steps", "3", "--out", str(out),
                     "--timing-workload", "short", "--against-simulator", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    results = {r["mode"]: r for r in report["results"]}
    assert list(results) == ["sync", "async", "seamless"]
    assert "modelled" in report["modelled"]["timing"] and "real: the scheduler" in report["modelled"]["timing"]
    assert "published figures" in report["modelled"]["timing"]  # the GPU costs, the default
    assert report["timing_workload"] == "short" and report["timing_speedup"] == DEFAULT_SPEEDUP
    for mode in ("sync", "async"):
        r = results[mode]
        assert r["available"] and r["ranks"] == 4 and r["steps"] == 2, r
        assert r["trained_tokens_per_s"] > 0 and r["tokens_discarded"] >= 0
        assert Path(r["chart"]).stat().st_size > 0 and r["timeline"]
        spans = [e for e in json.loads(Path(r["trace"]).read_text())["traceEvents"] if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == {1, 2, 3}  # a track per rank of the timeline (the controller has none)
    seamless = results["seamless"]
    assert not seamless["available"] or Path(seamless["chart"]).exists()
    # The long tail leaves the synchronous pipeline waiting. Whether async waits less in two measured steps
    # depends on the machine's load as much as on the model (it lost once on a loaded machine): the bench's
    # figures are measured in docs/benchmarks.md, and the modes' order is asserted on the deterministic
    # simulation (tests/bench/test_simulate.py).
    assert results["sync"]["bubble"]["overall"] > 0
    assert all(0 <= r["bubble"]["overall"] < 1 for r in (results["sync"], results["async"]))
    assert out.with_suffix(".png").exists()
    table = done.stdout[done.stdout.index("pipeline benchmark"):].splitlines()
    for mode in ("sync", "async", "seamless"):
        assert any(line.split()[:2] == ["timing", mode] for line in table if line.strip()), mode
    # The same configuration simulated: each mode's figures beside the controller's (sync is disaggregated here,
    # and the simulator's sync is colocated: left out, and said).
    compared = {r["mode"]: r for r in report["against_simulator"]["rows"]}
    assert set(compared) == {"async"} | ({"seamless"} if seamless["available"] else set())
    for mode, row in compared.items():
        assert row["timing_tokens_per_s"] == pytest.approx(results[mode]["trained_tokens_per_s"])
        assert row["sim_tokens_per_s"] > 0 and row["ratio"] == pytest.approx(row["timing_tokens_per_s"]
                                                                             / row["sim_tokens_per_s"])
    # The simulator models what the controller does: not within the benchmark's 15% here (two measured steps of
    # a 4-rank run on 2 cores shared with the other tests, where the real per-token work is a large share of a
    # modelled decode step: 0.80 for both modes on a quiet machine), but far from a mechanism one of them lacks
    # (a move the code never made gave 0.48), and what lending changes is modelled alike in both.
    ratios = {mode: row["ratio"] for mode, row in compared.items()}
    assert all(0.5 <= ratio <= 1.6 for ratio in ratios.values()), ratios
    if "seamless" in ratios:
        assert abs(ratios["seamless"] - ratios["async"]) <= 0.3, ratios
    assert report["against_simulator"]["prompt_tokens"] > 5
    assert "controller tok/s" in done.stdout and "sync is not compared" in done.stdout
    # The engines' pause per update, measured on the rollout ranks' timeline (their own account of it): staged
    # updates (the default), so at least the modelled load from the second copy, which the test engine sleeps
    # while paused, and far less than the modelled transfer, which the engines generated through.
    model = timing_recipe(4, timing_costs(None), model_path=None, speedup=DEFAULT_SPEEDUP,
                          workload="short")["timing_model"]
    for mode in ("sync", "async"):
        pause = results[mode]["engine_pause_s"]
        assert 0.9 * model["weight_load_s"] <= pause < 0.5 * model["weight_transfer_s"], (pause, model)
        assert f"timing {mode}: a weight update paused each engine" in done.stdout
