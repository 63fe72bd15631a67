"""submitit, extended for heterogeneous jobs.

submitit has no het-job support upstream. This executor keeps submitit's job model (pickled callable,
`Job` objects, states from sacct, results per task) and swaps in two things:

* the batch script comes from `sfhpc.launch.sbatch.render_sbatch` (one srun spanning every component);
* states are read from sacct's per-component lines (``123+0``, ``123+1``), which stock submitit cannot
  match to job ``123`` (its state would stay UNKNOWN); the job's state combines its components'.

Inside a het step ``SLURM_JOB_ID`` is the leader's id on every rank, so all ranks find the pickle and
write ``<id>_<rank>_result.pkl``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from sfhpc.errors import SlurmError
from sfhpc.launch.sbatch import SbatchSpec, render_sbatch
from sfhpc.runtime.slurm_job import combine_states


class HetSlurmInfoWatcher(SlurmInfoWatcher):
    """Reads sacct lines of het components (``N+k``) and adds a combined entry for job ``N``."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        components: dict[str, list[dict[str, str]]] = {}
        for job_id, stats in info.items():
            leader, plus, _ = job_id.partition("+")
            if plus:
                components.setdefault(leader, []).append(stats)
        for leader, parts in components.items():
            merged = dict(parts[0])
            merged["State"] = combine_states([p.get("State", "") for p in parts])
            merged["NodeList"] = ",".join(p.get("NodeList", "") for p in parts)
            info[leader] = merged
        return info


class HetSlurmJob(SlurmJob):
    watcher = HetSlurmInfoWatcher(delay_s=5)


class HetSlurmExecutor(SlurmExecutor):
    """A SlurmExecutor whose jobs are heterogeneous: `spec_for_command` gives the whole script."""

    job_class = HetSlurmJob

    def __init__(self, folder: Path, spec_for_command: Callable[[str], SbatchSpec], num_tasks: int,
                 python: str | None = None) -> None:
        for tool in ("sbatch", "srun", "sacct"):
            if shutil.which(tool) is None:
                raise SlurmError(f"'{tool}' not found on PATH: install the Slurm client tools, or run on one "
                                 "machine without Slurm with `sfhpc run RECIPE`")
        super().__init__(folder, python=python)
        self._spec_for_command = spec_for_command
        self._total_tasks = num_tasks

    def script_text(self) -> str:
        """The batch script that `submit` will write (for ``sfhpc render``)."""
        return render_sbatch(self._spec_for_command(self._submitit_command_str))

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(self._spec_for_command(command))

    def _num_tasks(self) -> int:
        return self._total_tasks

    def submit_program(self, program: Callable[[], Any]) -> HetSlurmJob:
        job = self.submit(program)
        assert isinstance(job, HetSlurmJob)
        return job
