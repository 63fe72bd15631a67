"""The reference pages are printed from the config dataclasses, every key has a description, renamed keys
name their new name, and the README's complete recipe loads."""

from __future__ import annotations

import dataclasses
import difflib
import re
import textwrap
from pathlib import Path

import pytest

from sfhpc.config import ClusterMap, Recipe, load_cluster_map, load_recipe
from sfhpc.config import recipe as recipe_module
from sfhpc.config.reference import PAGES, REGENERATE, Page, key_paths, render, sections, undocumented
from sfhpc.config.schema import Where, build, doc, setting
from sfhpc.config.yaml_source import read_yaml
from sfhpc.errors import ConfigError
from tests.conftest import RECIPES, ROOT

DOCS = ROOT / "docs"


@pytest.mark.parametrize("page", PAGES, ids=[p.file for p in PAGES])
def test_committed_reference_page_is_the_generated_one(page: Page) -> None:
    committed = DOCS / page.file
    generated = render(page)
    text = committed.read_text(encoding="utf-8") if committed.is_file() else ""
    diff = "\n".join(list(difflib.unified_diff(text.splitlines(), generated.splitlines(), "committed", "generated",
                                               lineterm=""))[:12])
    assert text == generated, f"docs/{page.file} is out of date: regenerate it with {REGENERATE}\n{diff}"


@pytest.mark.parametrize("root", [Recipe, ClusterMap])
def test_every_config_key_has_a_description(root: type) -> None:
    missing = undocumented(root)
    assert not missing, (f"keys without a description: {', '.join(missing)}; give each field one in "
                         f"{root.__module__}: setting(default, '...'), then {REGENERATE}")


@dataclasses.dataclass(frozen=True)
class _Inner:
    told: int = setting(1, "a key with its description")
    bare: int = 2  # a key someone added without one


@dataclasses.dataclass(frozen=True)
class _Outer:
    name: str = dataclasses.field(metadata=doc("the document's name"))
    inner: _Inner = setting(_Inner(), "a section")


def test_a_key_added_without_a_description_is_named_and_stops_the_page() -> None:
    assert undocumented(_Outer) == ["inner.bare"]
    page = Page("outer.md", "Outer", "outer", _Outer, {}, "")
    with pytest.raises(ValueError, match=r"inner\.bare: no description.*make docs"):
        render(page)


def test_reference_rows_come_from_the_fields() -> None:
    by_path = {s.path: {k.name: k for k in s.keys} for s in sections(Recipe)}
    assert list(by_path)[:3] == ["", "roles.<role>", "model"]
    steps = by_path["budgets"]["steps"]
    assert (steps.type, steps.default) == ("integer", "`20`") and steps.doc.startswith("training steps of the run (0,")
    mode = by_path["pipeline"]["mode"]
    assert mode.type == "`sync`, `async` or `seamless`" and mode.default == '`"sync"`'
    assert by_path["algorithm"]["clip_ratio_high"].type == "number or null"
    assert by_path["roles.<role>"]["<role>"].entry and by_path[""]["name"].default == "*required*"
    assert by_path["launch"]["setup"].default == "`[]`" and by_path[""]["agent"].type == "section `agent` (optional)"
    # What a renamed key may point to: dotted keys, `*` for a role's name.
    paths = key_paths(Recipe)
    assert {"budgets.steps", "roles.*.gpus_per_task", "agent.command", "seed"} <= paths
    assert "roles.*.name" not in paths and "roles" in paths


RENAMED = {"budgets.old_steps": "budgets.steps", "roles.*.gpus": "roles.*.gpus_per_task"}
RECIPE = """\
    name: t
    budgets:
      old_steps: 3
    roles:
      controller: {place_with: trainer}
      trainer: {tags: [train], nodes: 1}
      rollout: {tags: [rollout], nodes: 2}
    """


def _build(path: Path, renamed: dict[str, str]) -> Recipe:
    data = read_yaml(path)
    return build(Recipe, data, Where(str(path), "", data.line), renamed=renamed)


def test_a_renamed_key_names_its_new_key_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(RECIPE))
    with pytest.raises(ConfigError) as info:
        _build(path, RENAMED)
    assert str(info.value) == f"{path}:3: budgets.old_steps: renamed to 'budgets.steps' (see CHANGELOG.md)"
    path.write_text(textwrap.dedent(RECIPE).replace("old_steps", "steps").replace("nodes: 1}", "nodes: 1, gpus: 1}"))
    with pytest.raises(ConfigError) as info:
        _build(path, RENAMED)  # a named entry's key: the role's name stands in the new key
    assert str(info.value) == (f"{path}:6: roles.trainer.gpus: renamed to 'roles.trainer.gpus_per_task' "
                               "(see CHANGELOG.md)")
    with pytest.raises(ConfigError) as info:
        _build(path, {})  # not in the table: still an unknown key, with the nearest one
    assert "roles.trainer.gpus: unknown key (did you mean 'gpus_per_task'?)" in str(info.value)


def test_sfhpc_refuses_a_renamed_recipe_key_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from sfhpc.cli import main

    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(RECIPE))
    monkeypatch.setattr(recipe_module, "RENAMED_KEYS", RENAMED)  # the loader's own table, with two entries
    assert main(["plan", str(path), "--cluster", str(RECIPES / "cluster-dev.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == f"sfhpc: error: {path}:3: budgets.old_steps: renamed to 'budgets.steps' (see CHANGELOG.md)\n"


@pytest.mark.parametrize("page", PAGES, ids=[p.file for p in PAGES])
def test_renamed_keys_lead_from_a_key_that_is_gone_to_one_that_exists(page: Page) -> None:
    now = key_paths(page.root)
    for old, new in page.renamed.items():
        assert old not in now, f"{old} is a key again; remove it from the table of renamed keys"
        assert new in now, f"{old} is renamed to {new}, which is no key of the {page.document}"


def test_the_readme_recipe_loads_and_resolves_on_the_gpu_site_map(tmp_path: Path) -> None:
    """The README's bring-your-own recipe is a recipe the loader takes, placed on the example GPU site."""
    from sfhpc.plan.resolve import resolve

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
    mine = [b for b in blocks if "agent:" in b and "task:" in b]
    assert len(mine) == 1, "the README should hold one complete recipe (a yaml block with task: and agent:)"
    path = tmp_path / "my-run.yaml"
    path.write_text(mine[0])
    recipe = load_recipe(path)
    assert recipe.model.path and recipe.task.name == "dataset" and recipe.agent is not None
    assert ":" in recipe.task.options["reward"]  # the user's reward function, by import path
    plan = resolve(recipe, load_cluster_map(RECIPES / "cluster-h100-l40s.yaml"))
    assert {r for c in plan.components for r in c.roles} == {"controller", "trainer", "rollout"}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_documents_lead_somewhere() -> None:
    """Every relative link of the README, the changelog and docs/ names a file that exists (and a heading
    that exists, for a #fragment): pages move, and a link left behind is found here."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, fragment = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and path.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", path.read_text(encoding="utf-8"), re.MULTILINE)
                if fragment not in {_slug(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
