"""Recipes and cluster maps: the shipped examples load, and every kind of bad input names file, line and key."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.errors import ConfigError, SfhpcError
from tests.conftest import RECIPES, assert_one_line_error, run_sfhpc

GOOD_RECIPE = """\
name: t
roles:
  controller: {place_with: trainer}
  trainer: {tags: [train], nodes: 1}
  rollout: {tags: [rollout], nodes: 2}
"""


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_shipped_examples_load() -> None:
    dev = load_cluster_map(RECIPES / "cluster-dev.yaml")
    assert [p.name for p in dev.pools] == ["h100", "l40s"]
    assert dev.pools[0].tags == ("train", "rollout", "cpu") and dev.pools[0].constraint == "h100"
    assert dev.tags == ("cpu", "reward", "rollout", "train")
    site = load_cluster_map(RECIPES / "cluster-h100-l40s.yaml")
    assert site.pools[0].gpus_per_node == 8 and site.pools[2].constraint is None
    recipe = load_recipe(RECIPES / "report.yaml")
    assert recipe.pipeline.mode == "async" and not recipe.colocated
    assert recipe.role("rollout").nodes == 2  # type: ignore[union-attr]
    assert load_recipe(RECIPES / "report-colocated.yaml").colocated
    gpu = load_recipe(RECIPES / "h100-l40s-grpo.yaml")
    assert gpu.algorithm.learning_rate == pytest.approx(1e-6) and gpu.role("trainer").gpus_per_task == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["demo", "guess-number", "arith-word", "report", "report-colocated",
                                  "h100-l40s-grpo"])
def test_every_shipped_recipe_resolves_on_its_cluster_and_is_runnable(name: str) -> None:
    from sfhpc.plan.resolve import resolve
    from sfhpc.rl.program import check_runnable

    recipe = load_recipe(RECIPES / f"{name}.yaml")
    cluster = load_cluster_map(RECIPES / ("cluster-h100-l40s.yaml" if name.startswith("h100") else "cluster-dev.yaml"))
    plan = resolve(recipe, cluster)
    assert plan.world_size >= 2 and {r for c in plan.components for r in c.roles} >= {"controller", "trainer"}
    if name.startswith("report"):  # launch checks (sfhpc probe): no task, so never an RL run
        with pytest.raises(SfhpcError, match="task: required"):
            check_runnable(recipe)
        return
    if name.startswith("h100"):  # the GPU site's model folder is not on this machine; the rest must hold
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, path=None))
    check_runnable(recipe)  # a task that builds, with its data; an available pipeline mode


def test_config_objects_are_immutable() -> None:
    recipe = load_recipe(RECIPES / "report.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.name = "other"  # type: ignore[misc]
    assert isinstance(recipe.roles, tuple) and isinstance(recipe.roles[0].tags, tuple)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("name: t\nroles: [unclosed\n", ["r.yaml:3", "malformed YAML"]),
        (GOOD_RECIPE.replace("nodes: 2", "nodse: 2"), ["r.yaml:5", "roles.rollout.nodse", "did you mean 'nodes'"]),
        (GOOD_RECIPE + "pipelin: {mode: sync}\n", ["r.yaml:6", "pipelin", "did you mean 'pipeline'"]),
        ("roles:\n  trainer: {tags: [train]}\n", ["missing required key 'name'"]),
        (GOOD_RECIPE.replace("nodes: 2", "nodes: two"), ["roles.rollout.nodes", "expected an integer", "'two'"]),
        (GOOD_RECIPE + "pipeline: {mode: fast}\n", ["pipeline.mode", "one of 'sync', 'async', 'seamless'"]),
        (GOOD_RECIPE.replace("  rollout: {tags: [rollout], nodes: 2}\n", ""), ["missing role 'rollout'"]),
        (GOOD_RECIPE + "name: again\n", ["r.yaml:6", "name: key appears twice"]),
        ("", ["expected a mapping of keys at the top level, found an empty file"]),
        (GOOD_RECIPE.replace("{place_with: trainer}", "{place_with: reward}"), ["which the recipe lacks"]),
        (GOOD_RECIPE.replace("nodes: 1", "nodes: 0"), ["roles.trainer.nodes", "at least 1"]),
        (GOOD_RECIPE.replace("trainer: {tags: [train], nodes: 1}", "trainer: {nodes: 1}"), ["needs 'tags'"]),
        (GOOD_RECIPE.replace("rollout: {tags: [rollout], nodes: 2}", "rollout: {colocate_with: trainer}")
         + "pipeline: {mode: async}\n", ["pipeline.mode", "use mode 'sync'"]),
        (GOOD_RECIPE.replace("  rollout:", "  reward: {tags: [reward], nodes: 1}\n  rollout:"),
         ["roles.reward", "is not built", "remove this role"]),
        (GOOD_RECIPE + "training: {keep_checkpoints: 0}\n", ["training.keep_checkpoints", "at least 1"]),
        (GOOD_RECIPE + "model: {path: /m, build: {layers: 2}}\n", ["r.yaml:6", "model.build", "shapes the model sfhpc "
                                                                   "builds", "leave it out with a model folder"]),
        (GOOD_RECIPE + "model: {warm_start_steps: 10}\n", ["r.yaml:6", "model.warm_start_steps: renamed to "
                                                            "'model.build.warm_start_steps'"]),
        (GOOD_RECIPE + "model: {build: {hidden_size: 100}}\n", ["model.build.hidden_size", "heads x 64 = 256"]),
    ],
    ids=["malformed", "unknown-nested-key", "unknown-top-key", "missing-field", "wrong-type", "bad-choice",
         "missing-role", "duplicate-key", "empty", "bad-reference", "zero-nodes", "no-tags", "async-colocated",
         "reward-role", "keep-no-checkpoint", "build-beside-path", "build-key-renamed", "build-shape"],
)
def test_bad_recipe_names_file_line_and_key(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = write(tmp_path, text)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message
    assert path.read_bytes() == before  # nothing a user wrote is touched


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("cluster: c\npools:\n  a: {partition: p, nodes: 1, tags: [train], cpus_per_node: 4, memory_mb: 1,"
         " gpus: 2}\n", ["cluster.yaml:3", "pools.a.gpus", "did you mean 'gpus_per_node'"]),
        ("cluster: c\npools:\n  a: {partition: p, nodes: 1, cpus_per_node: 4, memory_mb: 1}\n",
         ["missing required key 'tags'"]),
        ("cluster: c\npools: {}\n", ["the map lists no pools"]),
        ("cluster: c\npools:\n  a: {partition: p, nodes: 1, tags: [train], cpus_per_node: 4, memory_mb: 1}\n"
         "  b: {partition: p, nodes: 1, tags: [x], cpus_per_node: 4, memory_mb: 1}\n", ["both select p"]),
        ("cluster: c\npools:\n  a: {partition: p, nodes: 1, tags: [tr ain], cpus_per_node: 4, memory_mb: 1}\n",
         ["tag 'tr ain'"]),
    ],
    ids=["unknown-key", "missing-tags", "no-pools", "duplicate-pool", "bad-tag"],
)
def test_bad_cluster_map(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = write(tmp_path, text, "cluster.yaml")
    with pytest.raises(ConfigError) as info:
        load_cluster_map(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_cli_bad_recipe_is_one_line_without_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD_RECIPE.replace("nodes: 2", "nodse: 2"))
    done = run_sfhpc("plan", str(path))
    assert_one_line_error(done, f"{path}:5", "did you mean 'nodes'")
    done = run_sfhpc("plan", str(tmp_path / "missing.yaml"))
    assert_one_line_error(done, "missing.yaml", "file not found")
    done = run_sfhpc("tags", "show", str(write(tmp_path, "cluster: [1, 2\n", "m.yaml")))
    assert_one_line_error(done, "m.yaml", "malformed YAML")


def test_launch_defaults_outlive_the_allocation() -> None:
    launch = load_recipe(RECIPES / "report.yaml").launch
    assert (launch.requeue, launch.signal_grace_s, launch.max_restarts) == (True, 120, 3)


@pytest.mark.parametrize(
    ("launch", "fragments"),
    [
        ("{time_minutes: 2, signal_grace_s: 120}", ["r.yaml:9", "launch.signal_grace_s",
                                                     "less than the time limit (120 s", "found 120"]),
        ("{signal_grace_s: 0}", ["r.yaml:8", "launch.signal_grace_s", "more than 0"]),
        ("{max_restarts: -1}", ["r.yaml:8", "launch.max_restarts", "0 (never) or more"]),
        ("{requeue: maybe}", ["launch.requeue", "expected true or false"]),
        ("{time_minutes: 0}", ["launch.time_minutes", "at least 1"]),
    ],
    ids=["grace-beyond-limit", "grace-zero", "negative-restarts", "requeue-not-bool", "no-time"],
)
def test_bad_launch_settings(tmp_path: Path, launch: str, fragments: list[str]) -> None:
    path = write(tmp_path, GOOD_RECIPE + "seed: 1\nlaunch:\n  " + launch.strip("{}").replace(", ", "\n  ") + "\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_launch_settings_that_fit() -> None:
    from sfhpc.config.recipe import LaunchSpec
    from sfhpc.config.schema import Where

    LaunchSpec(time_minutes=2, signal_grace_s=119).validate(Where("r.yaml", "launch", 1))
    # Without requeue no signal is asked for: the grace does not have to fit the limit then.
    LaunchSpec(time_minutes=1, requeue=False).validate(Where("r.yaml", "launch", 1))
    with pytest.raises(ConfigError, match="less than the time limit"):
        LaunchSpec(time_minutes=1).validate(Where("r.yaml", "launch", 1))


# YAML double-quoted escapes: a newline, a carriage return, a tab, an escape, a Unicode line separator.
CONTROL = [(r"\n", "a newline"), (r"\r", "a newline"), (r"\t", "U+0009"), (r"\e", "U+001B"), (r"\u2028", "U+2028")]


@pytest.mark.parametrize(("escape", "what"), CONTROL, ids=["newline", "return", "tab", "escape", "line-separator"])
@pytest.mark.parametrize(
    ("key", "line"),
    [("name", None), ("output_dir", None), ("model: {path", "}"), ("launch: {job_name", "}"),
     ("launch: {account", "}"), ("launch: {qos", "}"), ("launch: {mpi", "}"), ("launch: {extra_sbatch: [", "]}")],
    ids=["name", "output_dir", "model.path", "job_name", "account", "qos", "mpi", "extra_sbatch"],
)
def test_recipe_strings_that_reach_the_batch_script_are_one_plain_line(
        tmp_path: Path, key: str, line: str | None, escape: str, what: str) -> None:
    value = f'"x{escape}touch /tmp/pwned"'
    if line is None:
        text = (GOOD_RECIPE.replace("name: t\n", "") if key == "name" else GOOD_RECIPE) + f"{key}: {value}\n"
    elif "[" in key:
        text = GOOD_RECIPE + f"{key}{value}{line}\n"
    else:
        text = GOOD_RECIPE + f"{key}: {value}{line}\n"
    with pytest.raises(ConfigError) as info:
        load_recipe(write(tmp_path, text))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'r.yaml'}:") and "\n" not in message
    dotted = {"model: {path": "model.path", "launch: {extra_sbatch: [": "launch.extra_sbatch[0]"}.get(
        key, key.replace(": {", "."))
    assert f": {dotted}: " in message, message
    if key != "name":  # the recipe name has its own, stricter rule (letters, digits, '-', '_')
        assert what in message and "one plain line" in message, message


def test_setup_lines_are_shell_and_may_span_lines(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD_RECIPE + 'launch:\n  setup: ["module load openmpi\\nexport X=1", "echo\\tready"]\n')
    assert load_recipe(path).launch.setup == ("module load openmpi\nexport X=1", "echo\tready")


@pytest.mark.parametrize(
    ("key", "dotted"),
    [("cluster: c", "cluster"), ("partition: p", "pools.a.partition"), ("constraint: h100", "pools.a.constraint")],
)
def test_map_strings_are_one_plain_line(tmp_path: Path, key: str, dotted: str) -> None:
    text = ("cluster: c\npools:\n  a:\n    partition: p\n    constraint: h100\n    nodes: 1\n    tags: [train]\n"
            "    cpus_per_node: 4\n    memory_mb: 1\n")
    name, value = key.split(": ")
    text = text.replace(key, f'{name}: "{value}\\n#SBATCH --uid=0"')
    with pytest.raises(ConfigError) as info:
        load_cluster_map(write(tmp_path, text, "m.yaml"))
    expected_line = text.splitlines().index(next(ln for ln in text.splitlines() if ln.strip().startswith(name))) + 1
    assert f"m.yaml:{expected_line}: {dotted}: holds a newline" in str(info.value)


def test_cli_render_of_a_recipe_with_a_newline_is_one_line_and_prints_nothing(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD_RECIPE + 'launch:\n  account: "rl\\nrm -rf ~"\n')
    done = run_sfhpc("render", str(path), "--cluster", str(RECIPES / "cluster-dev.yaml"))
    assert_one_line_error(done, f"{path}:7", "launch.account", "holds a newline")
    assert done.returncode == 2 and done.stdout == ""
    done = run_sfhpc("render", str(path), "--cluster", str(RECIPES / "cluster-dev.yaml"), "--template")
    assert_one_line_error(done, "launch.account") and done.stdout == ""


def test_an_attach_section_loads_and_is_refused_where_no_worker_could_join(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, GOOD_RECIPE + "attach: {rollout: 4, qos: preempt}\n"))
    assert recipe.attach is not None and (recipe.attach.rollout, recipe.attach.qos) == (4, "preempt")
    assert recipe.attach_refusal is None
    colocated = """\
    name: t
    roles:
      controller: {place_with: trainer}
      trainer: {tags: [train], nodes: 1}
      rollout: {colocate_with: trainer}
    attach: {rollout: 1}
    """
    with pytest.raises(ConfigError, match=r"attach: is refused: its trainer ranks roll out themselves \(colocated\)"):
        load_recipe(write(tmp_path, colocated))
    with pytest.raises(ConfigError, match="attach.rollout: must be at least 1 worker, found 0"):
        load_recipe(write(tmp_path, GOOD_RECIPE + "attach: {rollout: 0}\n"))
