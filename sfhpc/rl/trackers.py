"""Experiment trackers: a run's step metrics, its recipe and its reward curve in Weights & Biases or MLflow,
beside ``metrics.jsonl`` and the TensorBoard file every run writes (`sfhpc.rl.progress`, which feeds them).

One class per tracker behind `Tracker`; `open_trackers` starts those the recipe's ``logging`` names, on the
controller's rank. A run that resumes (a requeue, ``sfhpc run --resume``) continues the same wandb run and
MLflow run: their ids are kept in the run folder (``RunPaths.trackers``) with the last step each one holds,
and a step a tracker holds already is not sent again. A resume that rolls steps back (steps trained after
its checkpoint by weights the restart lost) leaves those steps there as first logged, since both keep a
run's history append-only; ``metrics.jsonl`` holds the steps kept.

MLflow stores a step when the call returns. wandb's service process (``wandb-core``) writes the steps on its
own, and TERM or INT ends it at once (it leaves USR1 and USR2, the stop signals sfhpc asks Slurm for ahead of
a time limit, to the run): a session that ends without closing its wandb run counts none of its steps as
held, and the next session sends them again.

A tracker that fails while the run goes on (its server unreachable, say) says so in one line and stops
logging; the run does not stop for it. One that cannot start (the package missing, a wrong URI) ends the run
before its first step with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from sfhpc.config.recipe import MlflowSpec, Recipe, WandbSpec
from sfhpc.errors import SfhpcError
from sfhpc.rundir import RunPaths
from sfhpc.runtime import preemption

log = logging.getLogger("sfhpc")

PARAM_CHARS = 500   # MLflow refuses longer parameter values
PARAMS_PER_CALL = 100


class Tracker(Protocol):
    name: str
    synchronous: bool  # a step is stored when `log` returns (else only once `finish` returns)

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def finish(self, plot: Path | None, *, complete: bool) -> None: ...


def recipe_config(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain data (what the trackers record as the run's config)."""
    return json.loads(json.dumps(dataclasses.asdict(recipe), default=str))


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: MLflow's parameters are flat strings."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


class TrackerState:
    """The trackers' ids and last steps, kept in the run folder across restarts."""

    def __init__(self, paths: RunPaths) -> None:
        self.path = paths.trackers
        self.values: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def set(self, key: str, value: Any) -> None:
        self.values[key] = value
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.values))
        partial.replace(self.path)


class WandbTracker:
    """A wandb run (``logging.wandb``): config = the recipe; each step's metrics at that step; the reward
    curve in the summary at the end. Offline mode writes it under the run folder (``wandb/``)."""

    name = "wandb"
    synchronous = False  # its service process writes the steps; a stop signal that kills it loses the unwritten

    def __init__(self, spec: WandbSpec, recipe: Recipe, paths: RunPaths, state: TrackerState) -> None:
        import wandb

        self.wandb, self.state = wandb, state
        run_id = state.get("wandb_id") or secrets.token_hex(8)  # wandb ids: letters and digits, unique per project
        self.run = wandb.init(project=spec.project, entity=spec.entity, name=spec.name or paths.root.name,
                              id=run_id, resume="allow", mode=spec.mode, dir=str(paths.root),
                              config=recipe_config(recipe), settings=wandb.Settings(silent=True, console="off"))
        state.set("wandb_id", run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, plot: Path | None, *, complete: bool) -> None:
        if plot is not None:
            self.run.summary["reward_curve"] = self.wandb.Image(str(plot))
        self.run.finish(exit_code=0 if complete else 1)


class MlflowTracker:
    """An MLflow run (``logging.mlflow``) in the named experiment: the recipe as flat parameters and as
    ``recipe.json``; each step's metrics at that step; ``reward.png`` at the end. A run stopped for a
    requeue is marked KILLED, and RUNNING again when it resumes."""

    name = "mlflow"
    synchronous = True

    def __init__(self, spec: MlflowSpec, recipe: Recipe, paths: RunPaths, state: TrackerState) -> None:
        from mlflow.tracking import MlflowClient

        uri = spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is not None and uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless told: a recipe that
            # names a file: URI asks for it (offline runs, tests).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        run_id = state.get("mlflow_run_id")
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(spec.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(spec.experiment))
            run_id = self.client.create_run(experiment_id, run_name=paths.root.name,
                                            tags={"sfhpc.run_folder": str(paths.root)}).info.run_id
            config = recipe_config(recipe)
            params = [(k, v[:PARAM_CHARS]) for k, v in flat(config).items()]
            from mlflow.entities import Param

            for start in range(0, len(params), PARAMS_PER_CALL):
                self.client.log_batch(run_id, params=[Param(k, v) for k, v in params[start:start + PARAMS_PER_CALL]])
            self.client.log_dict(run_id, config, "recipe.json")
            state.set("mlflow_run_id", run_id)
        self.run_id = run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, plot: Path | None, *, complete: bool) -> None:
        if plot is not None:
            self.client.log_artifact(self.run_id, str(plot))
        self.client.set_terminated(self.run_id, status="FINISHED" if complete else "KILLED")


class Trackers:
    """The recipe's trackers, fed by `sfhpc.rl.progress.Progress`: each step's numeric metrics once."""

    def __init__(self, trackers: list[Tracker], state: TrackerState) -> None:
        self.trackers, self.state = trackers, state
        self.logged: dict[str, int] = {}  # steps sent to a tracker that stores them only at `finish`

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        metrics = {k: float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in list(self.trackers):
            key = f"{tracker.name}_step"
            last = self.state.get(key)
            if last is not None and step <= last:
                continue  # it holds this step already (a resume that rolled steps back); step 0: the evaluation
            if self._guarded(tracker, lambda t=tracker: t.log(step, metrics)):
                if tracker.synchronous:
                    self.state.set(key, step)
                else:
                    self.logged[key] = step

    def finish(self, plot: Path | None, *, complete: bool) -> None:
        for tracker in list(self.trackers):
            key = f"{tracker.name}_step"
            if self._guarded(tracker, lambda t=tracker: t.finish(plot, complete=complete)) and key in self.logged:
                self.state.set(key, self.logged[key])
        self.trackers = []

    def _guarded(self, tracker: Tracker, call: Any) -> bool:
        """Run `call`; on an error, say so in one line and stop using `tracker` (returns False)."""
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a tracker's fault never stops the run
            print(f"sfhpc: {tracker.name}: logging stopped: {type(exc).__name__}: {exc}", flush=True)
            log.warning("%s: logging stopped", tracker.name, exc_info=exc)
            self.trackers.remove(tracker)
            return False
        return True


# The recipe's ``logging`` key of each tracker: its class and the package it needs.
KINDS: dict[str, tuple[type[WandbTracker] | type[MlflowTracker], str]] = {
    "wandb": (WandbTracker, "wandb"), "mlflow": (MlflowTracker, "mlflow")}


def tracker_problems(recipe: Recipe) -> list[str]:
    """One line for each tracker the recipe names whose package is not installed here (checked before any
    job starts, `sfhpc.rl.program.runnable_problems`)."""
    import importlib.util

    return [f"{recipe.source}: logging.{name}: the {package} package is not installed; pip install "
            f"'sfhpc[logging]' (or remove logging.{name})" for name, (_, package) in KINDS.items()
            if getattr(recipe.logging, name) is not None and importlib.util.find_spec(package) is None]


def open_trackers(recipe: Recipe, run_dir: Path) -> Trackers:
    """Start the trackers the recipe's ``logging`` names (none: an empty set)."""
    paths = RunPaths(run_dir)
    state = TrackerState(paths)
    trackers: list[Tracker] = []
    for name, (kind, _) in KINDS.items():
        spec = getattr(recipe.logging, name)
        if spec is None:
            continue
        try:
            # wandb's service process must outlive a stop signal (Slurm signals every process of the step), so
            # that the controller can still close the run at its safe point.
            with preemption.ignored_in_children():
                trackers.append(kind(spec, recipe, paths, state))  # type: ignore[arg-type]
        except ImportError as exc:
            raise SfhpcError(f"logging.{name}: the {exc.name or name} package is not installed; pip install "
                             f"'sfhpc[logging]' (or remove logging.{name})") from None
        except Exception as exc:  # noqa: BLE001 - the tracker's own error, named in one line
            raise SfhpcError(f"logging.{name}: cannot start: {type(exc).__name__}: {exc}") from None
    return Trackers(trackers, state)
