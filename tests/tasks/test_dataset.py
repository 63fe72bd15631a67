"""The dataset task: rows of a JSON-lines or Parquet file, drawn without repeats per epoch, the sampler's
position kept across a checkpoint, and every bad input named (file, row, key) before a job starts."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from sfhpc.config import load_recipe
from sfhpc.config.recipe import TaskSpec
from sfhpc.errors import ConfigError
from sfhpc.rl.resume import ControllerState
from sfhpc.tasks import get_task
from sfhpc.tasks.dataset import DatasetTask
from sfhpc.tasks.rewards import VerlReward


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset(tmp_path: Path, rows: list[object] | None = None, **options: object) -> DatasetTask:
    if rows is not None:
        write_jsonl(tmp_path / "train.jsonl", rows)
    spec = TaskSpec("dataset", {"path": "train.jsonl", "prompt": "q", "answer": "a", **options},
                    base_dir=str(tmp_path))
    task = get_task(spec, "r.yaml")
    assert isinstance(task, DatasetTask)
    return task


def numbered(count: int) -> list[dict[str, object]]:
    return [{"q": f"what is {i}?", "a": f"#### {i}"} for i in range(count)]


def test_rows_become_episodes_judged_by_the_reward(tmp_path: Path) -> None:
    rows = [{"q": "2 + 2?", "a": "#### 4"},
            {"q": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3 + 3?"}], "a": 6}]
    task = dataset(tmp_path, rows, reward="numeric", system="Answer with #### N.", max_reply_tokens=6)
    assert task.max_reply_tokens == 6 and task.max_turns == 1
    problems = {p.key: p for p in (task.sample(random.Random(0)) for _ in range(2))}
    first, second = task.episode(problems["0"]), task.episode(problems["1"])
    assert first.opening() == [{"role": "system", "content": "Answer with #### N."},
                               {"role": "user", "content": "2 + 2?"}]
    assert second.opening() == rows[1]["q"]  # its own system message is kept, the option's not added
    assert first.step("#### 4").reward == 1.0 and first.step("#### 5").reward == 0.0
    assert second.step("it is 6").reward == 1.0 and second.step("#### 6").done


def test_parquet_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
                             "a": ["hello", "hey"]}), tmp_path / "train.parquet")
    task = get_task(TaskSpec("dataset", {"path": "train.parquet", "prompt": "q", "answer": "a"},
                             base_dir=str(tmp_path)))
    task.check()
    episodes = {p.key: task.episode(p) for p in (task.sample(random.Random(1)) for _ in range(2))}
    assert episodes["1"].opening() == [{"role": "user", "content": "yo"}]
    assert episodes["1"].step(" hey ").reward == 1.0 and episodes["0"].step("hey").reward == 0.0  # exact


def test_each_epoch_visits_every_row_once_in_a_new_order(tmp_path: Path) -> None:
    task = dataset(tmp_path, numbered(7))
    rng = random.Random(5)
    keys = [task.sample(rng).key for _ in range(7 * 3)]
    epochs = [keys[i:i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e, key=int) == [str(i) for i in range(7)] for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and task.epoch == 2
    again = dataset(tmp_path)  # the same seed draws the same problems
    assert [again.sample(random.Random(5)).key for _ in range(1)] == keys[:1]


@pytest.mark.parametrize("cut", [0, 3, 7, 9])
def test_a_resumed_sampler_continues_its_epoch(tmp_path: Path, cut: int) -> None:
    """Cut after `cut` problems, the state saved as the controller saves it (`controller.json`) and restored
    into a fresh task and RNG: the problems after the cut are the uninterrupted run's, so the epoch neither
    repeats nor skips a row."""
    whole = dataset(tmp_path, numbered(7))
    rng = random.Random(11)
    uninterrupted = [whole.sample(rng).key for _ in range(14)]

    before = dataset(tmp_path)
    rng = random.Random(11)
    head = [before.sample(rng).key for _ in range(cut)]
    ControllerState(step=1, version=1, rng=rng.getstate(), next_group=cut, open_groups={},
                    task_state=before.state()).save(tmp_path / "controller.json", before)
    saved = ControllerState.load(tmp_path / "controller.json", before)
    after, rng = dataset(tmp_path), random.Random()
    after.restore(saved.task_state)
    rng.setstate(saved.rng)
    tail = [after.sample(rng).key for _ in range(14 - cut)]
    assert head + tail == uninterrupted
    assert sorted(uninterrupted[:7], key=int) == sorted(uninterrupted[7:], key=int) == [str(i) for i in range(7)]


def test_a_checkpoint_of_another_file_is_refused(tmp_path: Path) -> None:
    task = dataset(tmp_path, numbered(5))
    task.sample(random.Random(0))
    state = task.state()
    write_jsonl(tmp_path / "train.jsonl", numbered(6))
    with pytest.raises(ConfigError, match=r"train.jsonl has 6 rows, the checkpoint's sampler had 5"):
        dataset(tmp_path).restore(state)


def test_warm_start_replies_have_the_answer_format_not_the_answer(tmp_path: Path) -> None:
    rows = [{"q": f"{i} + 0?", "a": f"{i} + 0 = {i}\n#### {i}"} for i in range(10)]
    examples = dataset(tmp_path, rows, reward="numeric").warm_start_examples(random.Random(0), 200)
    replies = [e[-1]["content"] for e in examples]
    assert set(replies) == {str(i) for i in range(10)}  # the final number alone, as numeric reads it
    right = sum(e[-1]["content"] == e[0]["content"].split()[0] for e in examples)
    assert right < 50  # about 1 in 10: the content is another row's answer
    exact = dataset(tmp_path, rows).warm_start_examples(random.Random(0), 5)  # exact: another row's answer
    assert all(e[-1]["content"] in {r["a"] for r in rows} for e in exact)


def test_worked_warm_start_restates_the_row_with_another_rows_result(tmp_path: Path) -> None:
    rows = [{"q": f"had {i}, found 1.", "a": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(9)]
    task = dataset(tmp_path, rows, reward="numeric", warm_start="worked")
    examples = task.warm_start_examples(random.Random(0), 300)
    for example in examples:
        first = int(example[0]["content"].split()[1].rstrip(","))
        equation, _, result = example[-1]["content"].rpartition(" = ")
        assert equation == f"{first} + 1"  # the row's own worked solution, up to its result
        assert result in {str(i + 1) for i in range(9)}  # a result of the file's
    right = sum(e[-1]["content"].endswith(f"= {int(e[0]['content'].split()[1].rstrip(',')) + 1}") for e in examples)
    assert right < 80  # about 1 in 9: the result is another row's


@pytest.mark.parametrize(("rows", "options", "expected"), [
    (None, {}, "r.yaml: task.options.path: {dir}/train.jsonl does not exist"),
    ([], {}, "r.yaml: task.options.path: {dir}/train.jsonl holds no rows"),
    ([{"q": "x", "a": 1}, {"q": "y"}], {},
     "r.yaml: task.options: row 2 of {dir}/train.jsonl has no key 'a' (task.options.answer; the row's keys: q)"),
    ([{"question": "x", "a": 1}], {},
     "row 1 of {dir}/train.jsonl has no key 'q' (task.options.prompt; the row's keys: question, a)"),
    ([{"q": 3, "a": 1}], {}, "row 1 of {dir}/train.jsonl has a 'q' that is neither text nor a list of chat messages"),
    ([[1, 2]], {}, "row 1 of {dir}/train.jsonl is a list, not an object with keys"),
    ("not json\n", {}, "r.yaml: task.options.path: {dir}/train.jsonl line 1 is not JSON"),
    ("PAR1 garbage", {"path": "train.parquet"}, "{dir}/train.parquet is not a readable Parquet file"),
    ([{"q": "x", "a": 1}], {"path": "train.csv"}, "task.options.path: {dir}/train.csv is not a .jsonl or .parquet"),
    ([{"q": "x", "a": 1}], {"prompt": None}, "task.options.prompt: required: the key of each row"),
    ([{"q": "x", "a": 1}], {"reward": "close"}, "task.options.reward: unknown reward 'close'"),
    ([{"q": "x", "a": 1}], {"reward": "scorers.py:score"}, "task.options.reward: cannot import 'scorers.py'"),
    ([{"q": "x", "a": 1}], {"shuffle": True}, "task.options.shuffle: unknown option (the dataset task takes path,"),
    ([{"q": "x", "a": 1}], {"max_reply_tokens": 0}, "task.options.max_reply_tokens: must be a whole number"),
    ([{"q": "x", "a": 1}], {"warm_start": "solved"},
     "task.options.warm_start: must be one of answer, number, worked, found 'solved'"),
])
def test_bad_input_is_named(tmp_path: Path, rows: object, options: dict[str, object], expected: str) -> None:
    if isinstance(rows, str):
        (tmp_path / options.get("path", "train.jsonl")).write_text(rows)  # type: ignore[operator]
    elif rows is not None:
        write_jsonl(tmp_path / "train.jsonl", rows)  # type: ignore[arg-type]
    spec = TaskSpec("dataset", {"path": "train.jsonl", "prompt": "q", "answer": "a", **options},
                    base_dir=str(tmp_path))
    with pytest.raises(ConfigError) as caught:
        get_task(spec, "r.yaml").check()
    assert expected.format(dir=tmp_path) in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_verl_data_file_and_reward_work_as_they_are(tmp_path: Path) -> None:
    """The shipped GSM8K-shaped parquet (written as verl writes one) and a reward with verl's signature: the
    nested ground truth by a dotted key, the reward called as verl calls it, with the row's data_source and
    extra_info, its dict's score taken."""
    from tests.conftest import ROOT

    recipe = load_recipe(ROOT / "recipes" / "gsm8k-verl.yaml")
    task = get_task(recipe.task, recipe.source)
    assert isinstance(task, DatasetTask) and isinstance(task.reward, VerlReward)
    problem = task.sample(random.Random(0))
    episode = task.episode(problem)
    [message] = episode.opening()
    assert message["role"] == "user" and message["content"].endswith('output the final answer after "####".')
    answer = problem.data["answer"]
    row = task.rows[int(problem.key)]
    assert answer == row[2]["extra_info"]["answer"].rpartition("#### ")[2]  # reward_model.ground_truth
    assert row[2]["data_source"] == "openai/gsm8k"
    assert episode.step(f"so #### {answer}").reward == 1.0 and episode.step("#### 1000").reward == 0.0

    # What verl passes, by keyword; a function may leave out data_source and extra_info, or take **kwargs.
    (tmp_path / "rewards.py").write_text(
        "SEEN = []\n"
        "def full(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    SEEN.append(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,\n"
        "                     extra_info=extra_info))\n"
        "    return 0.5\n"
        "def short(solution_str, ground_truth):\n    return {'score': 1, 'acc': True}\n"
        "def keywords(solution_str, ground_truth, **kwargs):\n    return float('data_source' in kwargs)\n"
        "def wrong(solution_str, ground_truth):\n    return 'yes'\n")
    rows = [{"prompt": [{"role": "user", "content": "1 + 1?"}], "data_source": "mine",
             "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 7}}]
    scores = {}
    for name in ("full", "short", "keywords"):
        task = dataset(tmp_path, rows, prompt="prompt", answer="reward_model.ground_truth",
                       reward=f"rewards.py:{name}")
        scores[name] = task.episode(task.sample(random.Random(0))).step("2").reward
    assert scores == {"full": 0.5, "short": 1.0, "keywords": 1.0}
    module = next(m for n, m in sys.modules.items() if n.startswith("sfhpc_user_rewards_"))
    seen = module.SEEN
    assert seen == [{"data_source": "mine", "solution_str": "2", "ground_truth": "2", "extra_info": {"index": 7}}]
    task = dataset(tmp_path, rows, prompt="prompt", answer="reward_model.ground_truth", reward="rewards.py:wrong")
    with pytest.raises(TypeError, match="must return a number or a dict with a numeric 'score'"):
        task.episode(task.sample(random.Random(0))).step("2")
    with pytest.raises(ConfigError, match=r"has no key 'reward_model.truth' \(task.options.answer"):
        dataset(tmp_path, rows, prompt="prompt", answer="reward_model.truth").check()


@pytest.mark.mpi
def test_the_verl_recipe_runs_as_shipped(tmp_path: Path) -> None:
    """`recipes/gsm8k-verl.yaml` as a user runs it, made short: the parquet's chat prompts reach the policy
    and the verl reward judges every reply."""
    import re

    from sfhpc.data.store_reader import open_store
    from tests.conftest import ROOT, run_recipe

    text = (ROOT / "recipes" / "gsm8k-verl.yaml").read_text().replace("../data/", f"{ROOT}/data/")
    text = re.sub(r"\nbudgets:\n(  .*\n)+", "\nbudgets: {steps: 2, prompts_per_step: 2}\n", text)
    text = text.replace("    warm_start_steps: 100\n", "    warm_start_steps: 0\n    layers: 1\n")
    text += "engine: {name: test}\n"
    run_dir, rows = run_recipe(tmp_path, text)
    assert [r["version"] for r in rows] == [1, 2]
    with open_store(run_dir / "trajectories.h5") as store:
        consumed = list(store.trajectories(status="consumed"))
    assert len(consumed) == 2 * 2 * 8 and all(t.reward in (0.0, 1.0) for t in consumed)
