"""Run folders and the job index.

Every run writes into one folder: ``<output_dir>/<recipe>-<UTC time>`` for ``sfhpc launch`` and
``sfhpc run``, ``<output_dir>/<recipe>-job<JOBID>`` for a job started from an sbatch template (a
requeued job keeps its id, so it finds its folder again). ``<output_dir>/jobs.tsv`` maps job ids to
run folders, so that ``sfhpc status|logs JOB`` can find them. `RunPaths` names every file and folder
inside a run folder: the one place that spells them.

A run folder holds the recipe, logs, prompts and replies, and the agent hosts' tokens: it is created mode 0700,
its user's alone, whatever the umask. A recipe's ``output_group`` shares it with one Unix group instead
(mode 2750, that group: its members read, nobody writes but the user, and new folders inside keep the group).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import grp
import os
from pathlib import Path

from sfhpc.errors import SfhpcError

INDEX_NAME = "jobs.tsv"
DAMAGED_SUFFIX = ".damaged"  # a log's cut last line is kept beside it, in <log name> + this (sfhpc.data.run_log)


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """The layout of one run folder (`root`): what the ranks, the CLI and the analysis read and write."""

    root: Path

    @property
    def store(self) -> Path:
        """The trajectory store (HDF5), written by the controller."""
        return self.root / "trajectories.h5"

    @property
    def events(self) -> Path:
        """Stops, checkpoints, restarts, the end: one JSON line each."""
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        """One JSON line per trained step."""
        return self.root / "metrics.jsonl"

    @property
    def metrics_discarded(self) -> Path:
        """The steps a resume rolled back (trained after the checkpoint it resumed from)."""
        return self.root / "metrics-discarded.jsonl"

    @staticmethod
    def damaged(log: Path) -> Path:
        """Where the cut last line of the JSON-lines log `log` is kept."""
        return log.with_name(log.name + DAMAGED_SUFFIX)

    @property
    def status(self) -> Path:
        """The run's live status (phase, step), rewritten as it goes."""
        return self.root / "status.json"

    @property
    def launch_report(self) -> Path:
        """Where every rank runs, proven over MPI at start."""
        return self.root / "launch_report.json"

    @property
    def recipe(self) -> Path:
        """The recipe the run was started with: its file (absolute) and the command line's overrides."""
        return self.root / "recipe.json"

    @property
    def evaluations(self) -> Path:
        """``sfhpc eval``'s runs of this run's checkpoints, a run folder each."""
        return self.root / "evaluations"

    @property
    def model(self) -> Path:
        """The model folder a run builds when its recipe names none."""
        return self.root / "model"

    @property
    def teacher(self) -> Path:
        """The distillation teacher's folder, when the recipe names a run to take it from."""
        return self.root / "teacher"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def export(self, step: int) -> Path:
        """The Hugging Face export of step `step` that ``training.export_every`` writes."""
        return self.root / "exports" / f"step-{step:06d}"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank:03d}.log"

    @property
    def reward_plot(self) -> Path:
        return self.root / "reward.png"

    @property
    def trackers(self) -> Path:
        """The experiment trackers' run ids and last steps (`sfhpc.rl.trackers`), kept across restarts."""
        return self.root / "trackers.json"

    @property
    def agent_hosts(self) -> Path:
        """One JSON file per agent host of an ``agents`` role (its URL and token, mode 0600): how the
        rollout ranks find them (`sfhpc.rollout.agent_host`)."""
        return self.root / "agent-hosts"

    @property
    def attach(self) -> Path:
        """Where the run's doors for rollout workers of other jobs are written (`sfhpc attach`): the controller's
        address and key (``controller.json``), the first trainer's weight server's (``weights.json``), each mode
        0600 (`write_register`)."""
        return self.root / "attach"

    @property
    def engine_doors(self) -> Path:
        """Where each rank's engine door is registered (``engine-<rank>.json``, address and key, mode 0600): how a
        rank whose agent program's episode moved reaches the engine its generation went to
        (`sfhpc.engine.remote`)."""
        return self.root / "engine-doors"

    def agent_host_log(self, name: str) -> Path:
        return self.logs / f"agent-host-{name}.log"

    @property
    def submitit(self) -> Path:
        """The job folder `sfhpc launch` hands to submitit (the pickled rank program, its results)."""
        return self.root / "submitit"

    def slurm_log(self, job_id: str) -> Path:
        """The batch script's output (every rank, labelled) of job `job_id`."""
        return self.root / f"slurm-{job_id}.out"

    @property
    def slurm_log_pattern(self) -> Path:
        """`slurm_log` as sbatch's ``--output`` names it (``%j``: the job id)."""
        return self.root / "slurm-%j.out"


PRIVATE_MODE = 0o700  # a run folder: its user's alone
SHARED_MODE = 0o2750  # shared with a group (recipe key output_group): it reads, and new folders inherit the group


def new_run_dir(output_dir: str | Path, recipe_name: str, *, group: str | None = None) -> Path:
    """Create and return a fresh, absolute run folder (never one that exists): mode 0700, or with `group`
    (the recipe's ``output_group``) that group's and mode 2750."""
    base = Path(output_dir).absolute()
    base.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    for suffix in ["", *(f"-{i}" for i in range(1, 1000))]:
        path = base / f"{recipe_name}-{stamp}{suffix}"
        try:
            path.mkdir(mode=PRIVATE_MODE)
        except FileExistsError:
            continue
        _protect(path, group)
        return path
    raise RuntimeError(f"cannot create a run folder under {base}")


def make_run_dir(path: Path, *, group: str | None = None) -> Path:
    """`path` as a run folder: created as `new_run_dir` creates one when it does not exist yet (a job's own
    folder); an existing folder (a requeue's, or one the user gave) keeps its mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=PRIVATE_MODE)
    except FileExistsError:
        return path
    _protect(path, group)
    return path


def _protect(path: Path, group: str | None) -> None:
    """The mode of a run folder just made (0700 whatever the umask; mkdir's mode went through it): its logs,
    recipe, trajectories and tokens are the user's; with `group`, readable by that group."""
    if group is None:
        os.chmod(path, PRIVATE_MODE)
        return
    try:
        gid = grp.getgrnam(group).gr_gid
        os.chown(path, -1, gid)
    except (KeyError, OSError) as exc:
        path.rmdir()
        why = "no such group here" if isinstance(exc, KeyError) else f"{exc.strerror}: you must be a member"
        raise SfhpcError(f"output_group {group!r}: cannot give run folders to that group ({why}); "
                         "set output_group to a group of yours (`id -Gn` lists them), or null") from None
    os.chmod(path, SHARED_MODE)


def write_register(folder: Path, name: str, record: dict[str, object]) -> Path:
    """Write `record` as ``<folder>/<name>.json``, readable by its owner alone (a register holds a token or a
    key), whole or not at all: readers never see half a record."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    partial = folder / f".{name}.json.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out)
    os.replace(partial, path)
    return path


def job_run_dir(output_dir: str | Path, recipe_name: str, job_id: str) -> Path:
    return Path(output_dir).absolute() / f"{recipe_name}-job{job_id}"


def given_or_job_run_dir(output_dir: str | Path, recipe_name: str, given: str | None,
                         job_id: str | None) -> Path | None:
    """The run folder a process of a job uses: the one given (``--run-dir``), else the Slurm job's own (a
    template's job, whose requeue finds it again); None when neither says."""
    if given:
        return Path(given).absolute()
    if job_id is not None:
        return job_run_dir(output_dir, recipe_name, job_id)
    return None


def record_job(output_dir: str | Path, job_id: str, run_dir: Path, recipe_source: str) -> None:
    """Append ``job_id -> run_dir`` to the index (a lock keeps concurrent writers' lines whole)."""
    index = Path(output_dir).absolute() / INDEX_NAME
    index.parent.mkdir(parents=True, exist_ok=True)
    line = f"{job_id}\t{run_dir}\t{recipe_source}\t{dt.datetime.now(dt.UTC).isoformat()}\n"
    with open(index, "a", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def jobs_of_run(output_dir: str | Path, run_dir: Path) -> list[str]:
    """The jobs the index of `output_dir` records for `run_dir`, oldest first."""
    index = Path(output_dir) / INDEX_NAME
    if not index.exists():
        return []
    rows = (line.split("\t") for line in index.read_text(encoding="utf-8").splitlines())
    return [fields[0] for fields in rows if len(fields) >= 2 and Path(fields[1]) == run_dir]


def find_run_dir(output_dir: str | Path, job_id: str) -> Path | None:
    """The run folder of `job_id` from the index, or None."""
    index = Path(output_dir) / INDEX_NAME
    if not index.exists():
        return None
    found = None
    for line in index.read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) >= 2 and fields[0] == job_id:
            found = Path(fields[1])
    return found


def record_recipe(run_dir: Path, source: str, overrides: dict[str, object]) -> None:
    """Note in the run folder which recipe file (and overrides) the run was started with (`RunPaths.recipe`)."""
    import json

    record = {"path": str(Path(source).resolve()), "overrides": overrides}
    RunPaths(run_dir).recipe.write_text(json.dumps(record, indent=1) + "\n")


def recorded_recipe(run_dir: Path) -> tuple[Path, dict[str, object]] | None:
    """The recipe file and overrides `record_recipe` noted, or None for a run that noted none."""
    import json

    path = RunPaths(run_dir).recipe
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return Path(record["path"]), dict(record.get("overrides") or {})
