"""A folder of built models, so that runs that would build the same tiny model build it once.

Building sfhpc's own model (`sfhpc.model.tiny`, then the warm start) is deterministic: the same recipe
model section, seed and task text give the same folder, byte for byte. A test suite or a sweep starts many
runs of a few such recipes, and each build costs seconds of CPU (the tokenizer's training, importing
transformers, the warm start's steps) on every run. With ``SFHPC_MODEL_CACHE=DIR`` set, a build is looked up
in ``DIR/<key>/`` and copied from there; a miss builds into a hidden folder of DIR and renames it into place
(atomic, so runs that build the same key at once never see half a folder). Unset, every run builds its own.

The key hashes everything a build reads: the recipe's ``model`` section and seed, the text of the task's
format examples (which carry the task's options and data), and the source of the modules that build.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

ENV = "SFHPC_MODEL_CACHE"
_BUILDERS = ("tiny.py", "hf_folder.py", "warm_start.py")  # sources whose change makes another model


def build_key(model_section: object, seed: int, task_texts: Iterable[str]) -> str:
    """The cache key of one build: a hash of its inputs and of the code that turns them into a folder."""
    digest = hashlib.sha256()
    section = (dataclasses.asdict(model_section)
               if dataclasses.is_dataclass(model_section) and not isinstance(model_section, type) else model_section)
    digest.update(json.dumps({"model": section, "seed": seed}, sort_keys=True, default=str).encode())
    for text in task_texts:
        digest.update(text.encode())
        digest.update(b"\0")
    here = Path(__file__).parent
    for name in _BUILDERS:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:32]


def build_or_copy(out_dir: Path, key: Callable[[], str], build: Callable[[Path], None]) -> bool:
    """Fill `out_dir` with the model `build` makes: from the cache when ``SFHPC_MODEL_CACHE`` holds it
    (returns True), else by building (into the cache too when one is set; returns False)."""
    root = os.environ.get(ENV)
    if not root:
        build(out_dir)
        return False
    cache = Path(root)
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / key()
    hit = (entry / "config.json").exists()
    if not hit:
        building = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=cache))
        build(building)
        try:
            building.rename(entry)
        except OSError:  # another run put the same build in place meanwhile
            shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(entry, out_dir, dirs_exist_ok=True)
    return hit
