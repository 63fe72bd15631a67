"""A recipe whose task cannot work is refused by ``sfhpc run`` and ``sfhpc launch`` in one line, before any
job starts and before anything is written: a bad data file, a reward or task that does not import or has
the wrong signature, a task with tools and a built model whose chat template renders none; ``sfhpc
check`` finds each of them alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RECIPES, assert_one_line_error, run_sfhpc

TASKS = {
    "missing file": ("{name: dataset, options: {path: gone.jsonl, prompt: q, answer: a}}",
                     "task.options.path: {dir}/gone.jsonl does not exist"),
    "empty file": ("{name: dataset, options: {path: empty.jsonl, prompt: q, answer: a}}",
                   "{dir}/empty.jsonl holds no rows"),
    "missing key": ("{name: dataset, options: {path: partial.jsonl, prompt: q, answer: a}}",
                    "row 2 of {dir}/partial.jsonl has no key 'a' (task.options.answer; the row's keys: q)"),
    "reward does not import": ("{name: dataset, options: {path: train.jsonl, prompt: q, answer: a, "
                               "reward: \"scoring.py:score\"}}",
                               "task.options.reward: cannot import 'scoring.py': NameError: name 'numpyy' is not "
                               "defined"),
    "reward signature": ("{name: dataset, options: {path: train.jsonl, prompt: q, answer: a, "
                         "reward: \"signatures.py:score\"}}",
                         "'signatures.py:score' has the signature (reply=''); it must take (reply, answer)"),
    "task is not a task": ("{name: \"signatures.py:score\"}", "'signatures.py:score' returned an object of type"),
    "tools the template does not render": ("{name: arith-tool}", "model.build.chat_format: task 'arith-tool' offers "
                                           "tools, which the 'brief' template does not render: use brief_tools"),
}


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text(json.dumps({"q": "1+1?", "a": 2}) + "\n")
    (tmp_path / "partial.jsonl").write_text(json.dumps({"q": "1+1?", "a": 2}) + "\n" + json.dumps({"q": "2+2?"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "scoring.py").write_text("import math\nnumpyy.array\n")
    (tmp_path / "signatures.py").write_text("def score(reply=''):\n    return 1.0\n")
    return tmp_path


@pytest.mark.parametrize("command", ["run", "launch", "check"])
@pytest.mark.parametrize("case", sorted(TASKS))
def test_a_bad_task_is_refused_before_any_job(project: Path, command: str, case: str) -> None:
    task, expected = TASKS[case]
    text = (RECIPES / "demo.yaml").read_text().replace("task:\n  name: next-letter\n", f"task: {task}\n")
    assert task in text
    recipe = project / "recipe.yaml"
    recipe.write_text(text + f"output_dir: {project / 'runs'}\n")
    # Started in another folder than the recipe's: relative names are the recipe folder's.
    done = run_sfhpc(command, str(recipe), "--cluster", str(RECIPES / "cluster-dev.yaml")) if command == "launch" \
        else run_sfhpc(command, str(recipe), cwd=Path("/"))
    assert_one_line_error(done, f"{recipe}: ", expected.format(dir=project))
    assert not (project / "runs").exists()
