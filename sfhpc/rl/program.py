"""One rank of an RL run: prepare the model, build the communicators, then play this rank's roles."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from sfhpc.config.recipe import Recipe
from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.rl.trackers import tracker_problems
from sfhpc.rundir import RunPaths
from sfhpc.runtime import fault
from sfhpc.runtime.comm_layout import build_comm_layout
from sfhpc.runtime.identity import RankIdentity
from sfhpc.runtime.idle_wait import bcast_when_ready
from sfhpc.tasks import Task, get_task

log = logging.getLogger("sfhpc")
FAULT_CLOSE_S = 10.0  # a failing rollout rank's clean-up, before every rank is ended


def check_runnable(recipe: Recipe) -> None:
    """Refuse, before any job starts, what this version cannot run (the first of `runnable_problems`)."""
    problems = runnable_problems(recipe)
    if problems:
        raise SfhpcError(problems[0])


def runnable_problems(recipe: Recipe) -> list[str]:
    """What in a loaded recipe would stop a run on every rank after the job started, one line each: the task
    (an unknown one, user code that does not import, a reward of the wrong signature, bad options or data
    file), the model folder (one the engines cannot load) and the experiment trackers' packages."""
    problems = []
    if not recipe.task.name:
        from sfhpc.tasks.registry import BUILTIN_TASKS

        problems.append(f"{recipe.source}: task: required: the task the agents learn ({', '.join(BUILTIN_TASKS)}, "
                        f"or your own as 'package.module:Name'); to check only where the ranks start, run "
                        f"`sfhpc probe {recipe.source}`")
    else:
        try:
            task = get_task(recipe.task, recipe.source)
            task.check()
            if recipe.evaluation is not None:  # its file read now, not in the job
                from sfhpc.rl.evaluation import Evaluation

                Evaluation(recipe.evaluation, task, source=recipe.source, seed=recipe.seed,
                           last_step=recipe.budgets.steps)
        except SfhpcError as exc:
            problems.append(str(exc))
        else:
            problems += _tool_format_problems(recipe, task)
    if recipe.model.init_from is not None and (problem := trained_policy_problem(Path(recipe.model.init_from))):
        problems.append(f"{recipe.source}: model.init_from: {problem}")
    if recipe.model.path is not None:
        from sfhpc.model.folder import model_folder_problem

        problem = model_folder_problem(Path(recipe.model.path), backend=recipe.training.backend)
        if problem is not None:
            problems.append(f"{recipe.source}: model.path: {recipe.model.path} {problem}; fix the path, or "
                            "leave model.path out to build sfhpc's own tiny model")
        else:
            from sfhpc.plan.model_layout import layout_problems
            from sfhpc.plan.run_memory import model_shape

            shape = model_shape(recipe)
            problems += layout_problems(recipe, shape) if shape is not None else []
    return problems + [p for p in [teacher_problem(recipe)] if p] + tracker_problems(recipe)


def trained_policy_problem(start: Path) -> str | None:
    """Why `start`, a run folder, one of its checkpoints or a PEFT LoRA adapter folder, gives no trained policy
    (`_model_from_run` takes one from it); None when it gives one."""
    from sfhpc.rl.export import ExportError, find_checkpoint, is_adapter_folder, read_adapter, split_checkpoint_path

    try:
        if is_adapter_folder(start):
            read_adapter(start)
        else:
            find_checkpoint(*split_checkpoint_path(start))
    except ExportError as exc:
        return str(exc)
    return None


def teacher_problem(recipe: Recipe) -> str | None:
    """What in ``algorithm.distill.teacher`` would stop the run once its ranks started (a missing folder, a run
    folder without a checkpoint), as one line; None when the teacher can be loaded."""
    distill = recipe.algorithm.distill
    if distill is None or (Path(distill.teacher) / "config.json").is_file():
        return None
    source, where = Path(distill.teacher), f"{recipe.source}: algorithm.distill.teacher"
    if not source.exists():
        return f"{where}: {source} does not exist; name the teacher's Hugging Face folder or a run folder"
    problem = trained_policy_problem(source)
    return None if problem is None else (f"{where}: {source} is no Hugging Face folder (no config.json) and no run "
                                         f"to take a policy from: {problem}")


def _tool_format_problems(recipe: Recipe, task: Task) -> list[str]:
    """A task that offers tools needs a built model whose chat template renders them."""
    from sfhpc.model.hf_folder import FORMATS

    chat_format = recipe.model.build.chat_format
    if not task.tools or recipe.model.path is not None or FORMATS[chat_format].renders_tools:
        return []
    return [f"{recipe.source}: model.build.chat_format: task '{recipe.task.name}' offers tools, which the "
            f"'{chat_format}' template does not render: use brief_tools, qwen2_tools or llama_tools"]


def prepare_model(recipe: Recipe, task: Task, run_dir: Path, world: Any) -> Path:
    """The policy's folder: the recipe's ``model.path``, or the project's tiny model that rank 0 builds
    (and warm-starts on the task's reply format) in the run folder. Collective: every rank gets the path."""
    path = None
    if world.Get_rank() == 0:
        if recipe.model.path is not None:
            path = Path(recipe.model.path)
        elif recipe.model.init_from is not None:
            path = RunPaths(run_dir).model
            if not (path / "config.json").exists():  # a restarted run keeps the model it started from
                _model_from_run(recipe.model.init_from, path)
        else:
            path = RunPaths(run_dir).model
            if not (path / "config.json").exists():  # a restarted run keeps the model it built
                _build_model(recipe, task, path)
    shared: str = bcast_when_ready(world, str(path) if path else "")  # rank 0 always has a path
    return Path(shared)


def prepare_teacher(recipe: Recipe, run_dir: Path, world: Any) -> Path | None:
    """The distillation teacher's Hugging Face folder (None without ``algorithm.distill``), every rank told
    (collective): the recipe's folder as it is, or the policy of the run it names, taken into the run folder by
    rank 0 as `model.init_from` takes one (once: a restarted job keeps it)."""
    distill = recipe.algorithm.distill
    if distill is None:
        return None
    path = Path(distill.teacher)
    if world.Get_rank() == 0 and not (path / "config.json").is_file():
        source, path = path, RunPaths(run_dir).teacher
        if not (path / "config.json").is_file():
            _model_from_run(str(source), path, what="teacher")
    return Path(bcast_when_ready(world, str(path)))


def _model_from_run(init_from: str, path: Path, what: str = "model") -> None:
    """The trained policy of another run (`init_from`: a run folder, or one of its checkpoint folders) as this
    run's model folder (or, `what`, its teacher's), in float32 so that training goes on from its master weights;
    or a PEFT LoRA adapter folder merged into its base model."""
    from sfhpc.rl.export import export, is_adapter_folder, merge_adapter_folder, split_checkpoint_path

    if is_adapter_folder(Path(init_from)):
        merge_adapter_folder(init_from, path, dtype="float32")
        print(f"{what}: the adapter {init_from} merged into its base model", flush=True)
        return
    run, step = split_checkpoint_path(Path(init_from))
    export(run, path, step=step, dtype="float32")
    print(f"{what}: from {init_from} (step {json.loads((path / 'sfhpc_export.json').read_text())['step']})",
          flush=True)


def _build_model(recipe: Recipe, task: Task, path: Path) -> None:
    """sfhpc's own model for this recipe, warm-started on the task's reply format (or the same build copied
    from ``SFHPC_MODEL_CACHE``, `sfhpc.model.build_cache`)."""
    from sfhpc.model.build_cache import build_key, build_or_copy
    from sfhpc.model.tiny import task_texts

    def build(folder: Path) -> None:
        from sfhpc.model.tiny import build_tiny_model
        from sfhpc.model.warm_start import warm_start

        build_tiny_model(recipe.model, folder, seed=recipe.seed, task=task)
        shape = recipe.model.build
        if shape.warm_start_steps:
            loss = warm_start(folder, task, steps=shape.warm_start_steps,
                              learning_rate=shape.warm_start_learning_rate, seed=recipe.seed)
            print(f"warm start: {shape.warm_start_steps} steps on the reply format, loss {loss:.3f}",
                  flush=True)

    def key() -> str:
        return build_key(recipe.model, recipe.seed, task_texts(task, recipe.seed, recipe.model.build.chat_format))

    if build_or_copy(path, key, build):
        print(f"model: the same build as before, from the cache ({path})", flush=True)


def find_resume_checkpoint(recipe: Recipe, run_dir: Path, model_dir: Path, world: Any) -> Any:
    """The newest sound checkpoint of the run folder (a restarted job, or ``sfhpc run --resume``), checked
    against this recipe and model; None for a new run. Collective: rank 0 looks, every rank gets the answer
    (a damaged checkpoint is named in the log and an earlier one used; a foreign one stops every rank)."""
    from sfhpc.rl.checkpoints import RunCheckpoints, check_identity, run_identity

    found, problem = None, None
    if world.Get_rank() == 0:
        def warn(line: str) -> None:
            log.warning("%s", line)
            print(f"sfhpc: warning: {line}", file=sys.stderr, flush=True)

        try:
            found = RunCheckpoints(run_dir).latest(warn=warn)
            if found is not None:
                check_identity(found, run_identity(recipe, model_dir))
        except SfhpcError as exc:
            found, problem = None, str(exc)
    found, problem = world.bcast((found, problem), root=0)
    if problem is not None:
        raise SfhpcError(problem)
    return found


def run_rl(identity: RankIdentity, world: Any, plan: LaunchPlan, recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    from sfhpc.rl.controller import Controller, describe, run_loop
    from sfhpc.rl.pipeline_policy import PipelinePolicy
    from sfhpc.rl.rank_commands import serve
    from sfhpc.rl.rollout_worker import RolloutWorker
    from sfhpc.rl.scheduler import Scheduler
    from sfhpc.rl.trainer_worker import TrainerWorker, build_trainer

    check_runnable(recipe)
    task = get_task(recipe.task, recipe.source)
    model_dir = prepare_model(recipe, task, run_dir, world)
    resume_from = find_resume_checkpoint(recipe, run_dir, model_dir, world)
    if resume_from is not None and resume_from.step >= recipe.budgets.steps:
        # Slurm may requeue a job that already finished: its run is complete, so nothing starts or is written.
        if identity.rank == 0:
            print(f"the run in {run_dir} is complete (checkpoint {resume_from.path.name}, step {resume_from.step} "
                  f"of {recipe.budgets.steps}); nothing to do", flush=True)
        return {"rank": identity.rank, "complete": True}
    teacher_dir = prepare_teacher(recipe, run_dir, world)
    layout = build_comm_layout(world, plan)
    if identity.has_role("teacher"):
        from sfhpc.rl.teacher_worker import TeacherWorker

        assert teacher_dir is not None  # a teacher role comes with algorithm.distill (the recipe's check)
        serve(layout, teacher=TeacherWorker(recipe, teacher_dir, model_dir, identity.rank))
        return {"rank": identity.rank, "roles": list(identity.roles)}
    if identity.has_role("controller"):
        from sfhpc.rollout.agent import reply_budget_line

        print(layout.describe(), flush=True)
        print(reply_budget_line(task, recipe.budgets.max_new_tokens), flush=True)
        controller = Controller(recipe, plan, layout, task, run_dir, model_dir=model_dir, resume_from=resume_from,
                                restart=identity.env.restart_count, job_id=identity.env.job_id)
        summary = run_loop(controller)
        plot = controller.progress.end(complete=controller.stopping is None)
        print(describe(summary, controller.progress, plot), flush=True)
        return {"rank": identity.rank, "steps": summary.steps, "first_reward": summary.first_reward,
                "last_reward": summary.last_reward, "store": str(summary.store),
                "store_share": summary.store_seconds / max(summary.seconds, 1e-9)}

    trainer_worker = None
    if identity.has_role("trainer"):
        trainer_state = resume_from.trainer_file if resume_from is not None else None
        takes_workers = recipe.attach_refusal is None
        trainer_worker = TrainerWorker(recipe, layout, build_trainer(recipe, layout, model_dir, trainer_state),
                                       attach=RunPaths(run_dir).attach if takes_workers else None)
    # seamless: a trainer rank whose node carries the rollout tag also holds an engine, lent to rollout
    # while the trainer waits for a batch (the controller's scheduler decides the same from the same plan).
    lendable = identity.rank in Scheduler(plan, lending=recipe.pipeline.mode == "seamless").lendable_ranks
    if identity.has_role("rollout") or lendable:
        def engine() -> Any:
            from sfhpc.engine.factory import start_engine

            return start_engine(recipe, model_dir, identity.rank, shares_gpu=trainer_worker is not None)

        from sfhpc.engine.tokenizer import load_tokenizer

        worker = RolloutWorker(recipe, task, layout, engine, trainer=trainer_worker.trainer if trainer_worker else None,
                               tokenizer=load_tokenizer(model_dir),  # the endpoint speaks the model's tokenizer
                               lendable=lendable, agent_hosts=RunPaths(run_dir).agent_hosts, model_dir=model_dir,
                               engine_doors=RunPaths(run_dir).engine_doors
                               if PipelinePolicy.of(recipe).routes_programs else None)
        try:
            assert trainer_worker is not None or not lendable  # lendable ranks are trainer ranks
            if trainer_worker is not None:
                trainer_worker.open_weight_stream()
            serve(layout, trainer=trainer_worker, rollout=worker, lent=lendable)
        except BaseException:
            # On the way to the fault path (sfhpc.runtime.fault): the agent programs and the engine are ended
            # first, but an engine that hangs must not hold the report back.
            fault.within(FAULT_CLOSE_S, worker.close, "rollout-close")
            raise
        worker.close()
    elif trainer_worker is not None:
        trainer_worker.open_weight_stream()
        serve(layout, trainer=trainer_worker)
    return {"rank": identity.rank, "roles": list(identity.roles)}

