"""What the batch scripts say about requeue and signals, and that nothing from a recipe, a map or the
command line can break out of its place in them (every script also passes `bash -n`)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from sfhpc.config import load_cluster_map, load_recipe
from sfhpc.launch.sbatch import SbatchSpec, comment_text, double_quoted, render_sbatch
from sfhpc.launch.slurm_launch import launch_spec, template_text
from sfhpc.plan.resolve import resolve
from tests.conftest import RECIPES, ROOT


def scripts(launch_changes: dict | None = None, recipe: str = "report.yaml") -> tuple[str, str]:
    """(launch script, template) of a shipped recipe on the dev map, with `launch_changes` applied."""
    loaded = load_recipe(RECIPES / recipe)
    if launch_changes:
        loaded = dataclasses.replace(loaded, launch=dataclasses.replace(loaded.launch, **launch_changes))
    cluster = load_cluster_map(RECIPES / "cluster-dev.yaml")
    plan = resolve(loaded, cluster)
    launch = render_sbatch(launch_spec(loaded, cluster, plan, Path("/runs/x"), "python3 -m entry", python="python3"))
    return launch, template_text(loaded, cluster, plan)


def directives(text: str, component: int = 0) -> list[str]:
    return [ln for ln in text.split("#SBATCH hetjob")[component].splitlines() if ln.startswith("#SBATCH ")]


def bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "script.sbatch"
    path.write_text(text)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_requeue_on_asks_slurm_to_requeue_signal_and_append(tmp_path: Path) -> None:
    for text in scripts({"signal_grace_s": 90, "max_restarts": 2}):
        first = directives(text)
        assert {"#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR1@90"} <= set(first)
        assert "#SBATCH --no-requeue" not in first
        assert not any("--signal" in d or "requeue" in d for d in directives(text, 1))  # component 0 only
        step = text.rstrip().splitlines()[-1]
        assert step.startswith("exec ")
        assert " -m sfhpc.launch.step_guard --ranks 4 --requeue-on-failure 2 -- srun " in step
        bash_n(text, tmp_path)


def test_requeue_off_says_no_requeue_and_asks_for_no_signal(tmp_path: Path) -> None:
    launch, template = scripts({"requeue": False})
    for text in (launch, template):
        first = directives(text)
        assert "#SBATCH --no-requeue" in first and "#SBATCH --requeue" not in first
        assert not any("--signal" in d for d in first) and "--requeue-on-failure" not in text
        assert text.rstrip().splitlines()[-1].startswith("exec ")  # signals still reach the step
        bash_n(text, tmp_path)
    assert "#SBATCH --open-mode=append" in directives(launch)  # its own log file, appended on a manual requeue
    assert "#SBATCH --open-mode=append" not in directives(template)


def test_shipped_scripts_pass_bash_n(tmp_path: Path) -> None:
    shipped = [*(ROOT / "slurm_templates").glob("*.sbatch"), *(ROOT / "tests/launch/golden").glob("*.sbatch")]
    assert len(shipped) == 9
    for path in shipped:
        bash_n(path.read_text(), tmp_path)


def test_comment_lines_cannot_be_left() -> None:
    text = render_sbatch(SbatchSpec(components=({"partition": "p"},), command="true",
                                    header=("recipe 'x'\ntouch /tmp/pwned", "a\rb\x1b[2Jc\u2028d")))
    lines = text.splitlines()
    assert lines[1] == "# recipe 'x'\\u000atouch /tmp/pwned" and lines[2] == "# a\\u000db\\u001b[2Jc\\u2028d"
    assert not any(ln.startswith("touch") for ln in lines)
    assert comment_text("plain: a-b_c [d] (e)") == "plain: a-b_c [d] (e)"


def test_sbatch_lines_refuse_line_breaks_and_values_are_quoted() -> None:
    for bad in ({"components": ({"partition": "p\n#SBATCH --uid=0"},)},
                {"components": ({"partition": "p"},), "extra_directives": ("--reservation=rl\nrm -rf ~",)}):
        with pytest.raises(ValueError, match="one plain line"):
            render_sbatch(SbatchSpec(command="true", **bad))  # type: ignore[arg-type]
    text = render_sbatch(SbatchSpec(components=({"partition": "a b", "account": "it's $(id)"},), command="true",
                                    environment={"X": "$(id) `id`"}))
    assert "#SBATCH --account='it'\"'\"'s $(id)'" in text and "#SBATCH --partition='a b'" in text
    assert "export X='$(id) `id`'" in text
    with pytest.raises(ValueError, match="environment variable name"):
        render_sbatch(SbatchSpec(components=({"partition": "p"},), command="true", environment={"A=1;B": "x"}))


def test_a_strange_map_path_stays_one_word_in_the_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    odd = tmp_path / 'site "map" $(touch pwned) `id` }x'
    odd.mkdir()
    path = odd / "cluster.yaml"
    path.write_text((RECIPES / "cluster-dev.yaml").read_text())
    recipe, cluster = load_recipe(RECIPES / "report.yaml"), load_cluster_map(path)
    text = template_text(recipe, cluster, resolve(recipe, cluster))
    bash_n(text, tmp_path)
    written_by = next(ln for ln in text.splitlines() if ln.startswith("# Written by:"))
    assert shlex.split(written_by.removeprefix("# Written by: "))[4] == str(path)  # copy-pastable as it is
    export = next(ln for ln in text.splitlines() if ln.startswith("export SFHPC_CLUSTER_MAP="))
    assert double_quoted(str(path)) in export
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "SFHPC_CLUSTER_MAP"}
    done = subprocess.run(["bash", "-c", f'{export}; printf %s "$SFHPC_CLUSTER_MAP"'], capture_output=True, text=True,
                          env=env, check=True)
    assert done.stdout == str(path) and not (tmp_path / "pwned").exists()
    done = subprocess.run(["bash", "-c", f'{export}; printf %s "$SFHPC_CLUSTER_MAP"'], capture_output=True, text=True,
                          env={**env, "SFHPC_CLUSTER_MAP": "mine.yaml"}, check=True)
    assert done.stdout == "mine.yaml"  # the user's choice still wins
