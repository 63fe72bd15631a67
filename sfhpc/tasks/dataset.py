"""``dataset``: single-turn problems from a data file (JSON lines or Parquet), judged by a verifiable reward.

    task:
      name: dataset
      options:
        path: data/train.jsonl     # .jsonl or .parquet; relative to the recipe's folder
        prompt: question           # the row's key holding the prompt text, or a list of chat messages
        answer: answer             # the row's key holding the reference answer, given to the reward
                                   # (a dotted key reads a nested one: reward_model.ground_truth)
        reward: numeric            # exact | numeric | package.module:function | file.py:function
        system: "Answer with #### and the number."   # optional system message before every prompt
        max_reply_tokens: 256      # optional: narrows budgets.max_new_tokens for this task's replies
        warm_start: number         # the format warm start's replies: answer | number | worked (see below)

The format warm start (``model.build.warm_start_steps``) pairs each prompt with a reply of the right form whose
result is another row's, so it is right only by chance: ``answer`` (the default with the ``exact`` reward)
is another row's whole answer; ``number`` (the default with ``numeric``) is another row's final number
alone; ``worked`` is the row's *own* worked solution (its answer before ``####``) with its last number, the
result, replaced by another row's final number: it teaches the model to restate the problem (``7 + 1 =``)
and writes a random result, so RL learns the result alone. Replies that never depend on the prompt teach
a tiny model to ignore the prompt (a few steps leave its next-token distribution the same for every
question), and RL then has no gradient through the question; ``worked`` replies depend on it. For a
multi-step problem a worked solution holds intermediate results: ``worked`` trains on those.

A data file as verl's preprocessing writes it (GSM8K: ``prompt`` a list of chat messages, ``reward_model:
{style, ground_truth}``, ``data_source``, ``extra_info``) is read as it is, with ``answer:
reward_model.ground_truth`` and a reward function of verl's signature (`sfhpc.tasks.rewards.VerlReward`),
which gets the row's ``data_source`` and ``extra_info`` too.

Problems are drawn without repeats within an epoch: each epoch visits every row once, in an order
shuffled with a seed drawn from the controller's seeded RNG, and the sampler's position (`state`) is saved
with every checkpoint, so a resumed run continues its epoch. Rows are read only where problems are drawn
(the controller) and where `check` runs (the command line, before any job starts); the rollout ranks get
each problem's messages and answer with the episode.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from sfhpc.errors import ConfigError
from sfhpc.tasks.base import Episode, Problem, StepResult, Task
from sfhpc.tasks.rewards import (
    ANSWER_MARK,
    BUILTIN_REWARDS,
    NUMBER,
    VERL_ROW_KEYS,
    Reward,
    VerlReward,
    final_number,
    get_reward,
    judge,
)

SUFFIXES = (".jsonl", ".parquet")
OPTIONS = ("path", "prompt", "answer", "reward", "system", "max_reply_tokens", "warm_start")
WARM_STARTS = ("answer", "number", "worked")


Row = tuple[list[dict[str, str]], Any, dict[str, Any]]  # opening messages, answer, what else the reward reads


class _DatasetEpisode(Episode):
    def __init__(self, messages: list[dict[str, str]], answer: Any, reward: Reward | VerlReward,
                 context: dict[str, Any]) -> None:
        self.messages, self.answer, self.reward, self.context = messages, answer, reward, context

    def opening(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.messages]

    def step(self, reply: str) -> StepResult:
        return StepResult(done=True, reward=judge(self.reward, reply, self.answer, self.context))


def lookup(row: dict[str, Any], key: str) -> Any:
    """The value of `key` in `row`: a key of its own, else a dotted path into nested objects
    (``reward_model.ground_truth``); KeyError when neither holds one."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


class DatasetTask(Task):
    name = "dataset"
    max_turns = 1

    def __init__(self, path: Path, *, prompt: str, answer: str, reward: Reward | VerlReward,
                 numeric_answers: bool = False,
                 system: str | None = None, max_reply_tokens: int | None = None, warm_start: str | None = None,
                 source: str = "recipe") -> None:
        self.path, self.prompt_key, self.answer_key, self.reward = path, prompt, answer, reward
        self.numeric_answers, self.system, self.max_reply_tokens, self.source = (
            numeric_answers, system, max_reply_tokens, source)
        self.warm_start = warm_start or ("number" if numeric_answers else "answer")
        self._rows: list[Row] | None = None
        self._seed: int | None = None  # with the epoch and position: the sampler (see `state`)
        self._epoch, self._position = 0, 0
        self._order: list[int] = []

    @classmethod
    def from_options(cls, options: dict[str, Any], *, source: str, base_dir: Path | None) -> DatasetTask:
        def key(name: str) -> str:
            return f"task.options.{name}"

        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(source, key(unknown[0]), f"unknown option (the dataset task takes {', '.join(OPTIONS)})")
        for name in ("path", "prompt", "answer"):
            if not isinstance(options.get(name), str) or not options[name]:
                raise ConfigError(source, key(name), "required: " + {
                    "path": "the data file (.jsonl or .parquet, relative to the recipe's folder)",
                    "prompt": "the key of each row that holds the prompt (text, or a list of chat messages)",
                    "answer": "the key of each row that holds the reference answer"}[name])
        path = Path(options["path"])
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        if path.suffix not in SUFFIXES:
            raise ConfigError(source, key("path"), f"{path} is not a {' or '.join(SUFFIXES)} file")
        reward_name = options.get("reward", "exact")
        reward = get_reward(reward_name, source=source, key=key("reward"), base_dir=base_dir)
        system = options.get("system")
        if system is not None and not isinstance(system, str):
            raise ConfigError(source, key("system"), "expected text (the system message before every prompt)")
        max_reply_tokens = options.get("max_reply_tokens")  # None: the recipe's budgets.max_new_tokens decides
        if max_reply_tokens is not None and (not isinstance(max_reply_tokens, int) or max_reply_tokens < 1):
            raise ConfigError(source, key("max_reply_tokens"), f"must be a whole number of at least 1, found "
                                                               f"{max_reply_tokens!r}")
        warm = options.get("warm_start")
        if warm is not None and warm not in WARM_STARTS:
            raise ConfigError(source, key("warm_start"), f"must be one of {', '.join(WARM_STARTS)}, found {warm!r}")
        return cls(path.resolve(), prompt=options["prompt"], answer=options["answer"], reward=reward,
                   numeric_answers=reward is BUILTIN_REWARDS["numeric"], system=system,
                   max_reply_tokens=max_reply_tokens, warm_start=warm, source=source)

    # -- the rows ---------------------------------------------------------------------------------------
    def check(self) -> None:
        self.rows  # noqa: B018 - reading them is the check

    @property
    def rows(self) -> list[Row]:
        """Every row as (opening messages, answer, what else the reward reads), read on first use."""
        if self._rows is None:
            self._rows = [self._row(i, row) for i, row in enumerate(self._read())]
            if not self._rows:
                raise ConfigError(self.source, "task.options.path", f"{self.path} holds no rows")
        return self._rows

    def _read(self) -> list[Any]:
        where = "task.options.path"
        if not self.path.is_file():
            raise ConfigError(self.source, where, f"{self.path} does not exist" if not self.path.exists()
                              else f"{self.path} is not a file")
        if self.path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                return pq.read_table(self.path).to_pylist()
            except Exception as exc:  # pyarrow's errors have no common base: any of them means unreadable
                message = " ".join(str(exc).split())
                raise ConfigError(self.source, where, f"{self.path} is not a readable Parquet file: {message}") \
                    from None
        rows = []
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError(self.source, where, f"{self.path} line {number} is not JSON: {exc.msg}") \
                        from None
        return rows

    def _row(self, index: int, row: Any) -> Row:
        def bad(problem: str) -> ConfigError:
            return ConfigError(self.source, "task.options", f"row {index + 1} of {self.path} {problem}")

        if not isinstance(row, dict):
            raise bad(f"is a {type(row).__name__}, not an object with keys")
        found = {}
        for name, key in (("prompt", self.prompt_key), ("answer", self.answer_key)):
            try:
                found[name] = lookup(row, key)
            except KeyError:
                keys = ", ".join(map(str, row)) or "none"
                raise bad(f"has no key '{key}' (task.options.{name}; the row's keys: {keys})") from None
        prompt = found["prompt"]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                      for m in prompt)):
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise bad(f"has a '{self.prompt_key}' that is neither text nor a list of chat messages "
                      "({role, content})")
        if self.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        context = {k: row.get(k) for k in VERL_ROW_KEYS} if isinstance(self.reward, VerlReward) else {}
        return messages, found["answer"], context

    def evaluation_problems(self, path: Path | None, count: int | None, seed: int, *, source: str) -> list[Problem]:
        """The first `count` rows (all when None) of the held-out file `path`, read with this task's keys and
        reward; a held-out file is required (the training file's rows are what the policy trains on)."""
        if path is None:
            raise ConfigError(source, "evaluation.path", "required for the dataset task: a held-out file with the "
                                                         f"same keys ({self.prompt_key}, {self.answer_key})")
        held_out = DatasetTask(path, prompt=self.prompt_key, answer=self.answer_key, reward=self.reward,
                               numeric_answers=self.numeric_answers, system=self.system, source=source)
        try:
            rows = held_out.rows
        except ConfigError as exc:  # named as the evaluation's file, not the task's
            raise ConfigError(source, "evaluation.path", exc.problem) from None
        return [held_out.problem(index) for index in range(len(rows[:count]))]

    # -- sampling without repeats per epoch -----------------------------------------------------------
    def sample(self, rng: random.Random) -> Problem:
        rows = self.rows
        if self._seed is None or self._position >= len(rows):
            if self._seed is not None:
                self._epoch += 1
            self._seed, self._position = rng.randrange(2**63), 0
            self._order = self._shuffled(len(rows), self._seed)
        index = self._order[self._position]
        self._position += 1
        return self.problem(index)

    def problem(self, index: int) -> Problem:
        """Row `index` as a problem (its key: the row's index)."""
        messages, answer, context = self.rows[index]
        return Problem(key=str(index), data={"messages": messages, "answer": answer, "context": context})

    @staticmethod
    def _shuffled(count: int, seed: int) -> list[int]:
        order = list(range(count))
        random.Random(seed).shuffle(order)
        return order

    def state(self) -> dict[str, Any]:
        # The order is its seed: a checkpoint stays small whatever the size of the file.
        return {"rows": len(self.rows), "epoch": self._epoch, "seed": self._seed, "position": self._position}

    def restore(self, state: dict[str, Any]) -> None:
        if state["rows"] != len(self.rows):
            raise ConfigError(self.source, "task.options.path",
                              f"{self.path} has {len(self.rows)} rows, the checkpoint's sampler had {state['rows']}; "
                              "resume with the data file the run started with")
        self._epoch, self._seed, self._position = state["epoch"], state["seed"], state["position"]
        self._order = self._shuffled(len(self.rows), self._seed) if self._seed is not None else []

    @property
    def epoch(self) -> int:
        return self._epoch

    def episode(self, problem: Problem) -> Episode:
        return _DatasetEpisode(problem.data["messages"], problem.data["answer"], self.reward,
                               problem.data.get("context", {}))

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, str]]]:
        # Format only: the result of each reply is another row's, right only by chance (see the module's
        # docstring for the three forms). ``number`` is the final number alone (what the numeric verifier
        # reads): a ``#### `` prefix would be tokens the reward does not depend on, and the loss, a mean
        # over the reply's tokens, would give the number a small share of each step.
        rows = self.rows
        examples = []
        for _ in range(count):
            messages, own, _ = rows[rng.randrange(len(rows))]
            _, other, _ = rows[rng.randrange(len(rows))]
            examples.append([*messages, {"role": "assistant", "content": self._format_reply(str(own), str(other))}])
        return examples

    def _format_reply(self, own: str, other: str) -> str:
        if self.warm_start == "answer":
            return other
        number = final_number(other)
        if number is None:
            return other
        result = f"{int(number) if number.is_integer() else number}"
        if self.warm_start == "number":
            return result
        worked = own.partition(ANSWER_MARK)[0].rstrip()
        last = None
        for last in NUMBER.finditer(worked):  # noqa: B007 - the last match is the result
            pass
        if last is None:
            return result
        return worked[:last.start()] + result + worked[last.end():]
