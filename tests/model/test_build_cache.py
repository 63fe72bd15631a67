"""The cache of built models (`sfhpc.model.build_cache`): one build per key, copies after it, keys that change
with every input of a build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfhpc.config.recipe import BuildSpec, ModelSpec
from sfhpc.model.build_cache import ENV, build_key, build_or_copy


def _builder(calls: list[Path]):  # type: ignore[no-untyped-def]
    def build(folder: Path) -> None:
        calls.append(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"built": len(calls)}))
    return build


def test_a_key_is_built_once_and_copied_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    assert build_or_copy(tmp_path / "run1" / "model", lambda: "k1", _builder(calls)) is False
    assert build_or_copy(tmp_path / "run2" / "model", lambda: "k1", _builder(calls)) is True
    assert len(calls) == 1 and calls[0].parent == tmp_path / "cache"  # built in the cache, not in a run
    for run in ("run1", "run2"):
        assert json.loads((tmp_path / run / "model" / "config.json").read_text()) == {"built": 1}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k1"]  # no hidden half-built folder left
    build_or_copy(tmp_path / "run3" / "model", lambda: "k2", _builder(calls))
    assert len(calls) == 2


def test_without_the_variable_every_run_builds_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    calls: list[Path] = []
    keys: list[str] = []
    for run in ("a", "b"):
        assert build_or_copy(tmp_path / run, lambda: keys.append("asked") or "k", _builder(calls)) is False
    assert calls == [tmp_path / "a", tmp_path / "b"] and keys == []  # no key computed, nothing cached


def test_the_key_changes_with_every_input() -> None:
    base = build_key(ModelSpec(), 1, ["abc", "def"])
    assert base == build_key(ModelSpec(), 1, ["abc", "def"])
    assert base != build_key(ModelSpec(), 2, ["abc", "def"])
    assert base != build_key(ModelSpec(build=BuildSpec(layers=3)), 1, ["abc", "def"])
    assert base != build_key(ModelSpec(build=BuildSpec(warm_start_steps=7)), 1, ["abc", "def"])
    assert base != build_key(ModelSpec(), 1, ["abc", "deg"])
    assert base != build_key(ModelSpec(), 1, ["ab", "cdef"])  # texts are delimited
