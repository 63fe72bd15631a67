"""The ``sfhpc`` command line.

    sfhpc launch RECIPE [--cluster MAP] [--wait] [--resume RUN_DIR]
                                                   submit one heterogeneous Slurm job (--resume: continue
                                                   that run's folder in a new job)
    sfhpc render RECIPE [--cluster MAP] [--template] print the batch script without submitting
    sfhpc run RECIPE [--cluster MAP] [--resume RUN_DIR] [--verbose]  run on this machine with mpiexec (no
                                                   Slurm); --resume continues a stopped run (exit 75:
                                                   stopped); --verbose: engine and library logs on the
                                                   console too (else in the run's logs/rank-NNN.log)
    sfhpc plan RECIPE [--cluster MAP]              show where every role and rank would run, and its memory
    sfhpc check RECIPE [--cluster MAP]             every check run (or launch, with a map) makes, one line each
    sfhpc probe RECIPE [--cluster MAP|--local] [--wait]  start the ranks and prove where they run (the
                                                   launch report over MPI), no RL and no task needed
    sfhpc status|logs|cancel JOB                   watch and control a submitted job
    sfhpc attach RUN --rollout N [--partition P] [--qos Q] [--time MIN] [--dry-run]
                                                   a job of rollout workers that join a running run
    sfhpc tags show|check MAP [--recipe R]         the admin's tag map, and its check against Slurm
    sfhpc export RUN --out DIR [--step N] [--adapter]  the trained policy as a Hugging Face folder
    sfhpc bench NAME|all [OPTIONS]                 benchmarks (figures of merit)
    sfhpc traj summary|export|plot|report RUN, show RUN ID, compare A B  a run's trajectory store

Errors a user can fix come out as one line on stderr and exit code 2; nothing is written then.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from sfhpc import __version__
from sfhpc.config import ClusterMap, Recipe, load_cluster_map, load_recipe
from sfhpc.config.overrides import parse as parse_overrides
from sfhpc.errors import SfhpcError
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.plan.resolve import resolve
from sfhpc.rundir import RunPaths
from sfhpc.terminal import printable

DEFAULT_CLUSTER_MAP = "recipes/cluster-dev.yaml"
FOLLOW_TICK_S = 0.05  # traj summary --follow: how soon a Ctrl-C ends the wait between reads


def _default_map() -> str:
    return os.environ.get("SFHPC_CLUSTER_MAP", DEFAULT_CLUSTER_MAP)


def _cluster_map(path: str) -> ClusterMap:
    """The cluster map `--cluster` names (the default one only where it exists)."""
    if path == DEFAULT_CLUSTER_MAP and not Path(path).exists():
        raise SfhpcError(f"no cluster map given and {DEFAULT_CLUSTER_MAP} is not in this folder: "
                         "pass --cluster MAP or set SFHPC_CLUSTER_MAP")
    return load_cluster_map(path)


def _load(args: argparse.Namespace) -> tuple[Recipe, ClusterMap, LaunchPlan]:
    recipe = load_recipe(args.recipe)
    cluster = _cluster_map(args.cluster)
    return recipe, cluster, resolve(recipe, cluster)


def cmd_check(args: argparse.Namespace) -> int:
    """Every check `run` (no --cluster) or `launch` (--cluster MAP) makes before starting, one line per problem;
    nothing printed for a recipe that passes."""
    from sfhpc.launch.preflight import problems

    found = problems(args.recipe, args.cluster)
    for line in found:
        print(f"sfhpc: error: {line}", file=sys.stderr)
    return 2 if found else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from sfhpc.plan.run_memory import planned_ranks, weight_copies

    recipe, cluster, plan = _load(args)
    print(plan.describe())
    for slot in plan.ranks():
        print(f"  rank {slot.rank}: component {slot.component}, roles {','.join(slot.roles)}")
    ranks = planned_ranks(recipe, cluster=cluster, plan=plan)
    if recipe.model.path is None:
        print("memory per rank: not planned (sfhpc builds its own tiny model)")
    elif ranks:
        print("memory per rank, at its peak (sfhpc.plan.memory):")
        for rank in ranks:
            print(f"  {rank.describe()}")
    for copy in weight_copies(recipe, plan, cluster):
        print(copy.describe())
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from sfhpc.launch.slurm_launch import executor_for, template_text

    recipe, cluster, plan = _load(args)
    if args.template:
        print(template_text(recipe, cluster, plan), end="")
        return 0
    placeholder = Path(recipe.output_dir).absolute() / f"{recipe.name}-<time>"
    print(executor_for(recipe, cluster, plan, placeholder).script_text(), end="")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from sfhpc.launch.slurm_launch import executor_for, resumable_in_new_job, submit
    from sfhpc.rl.program import check_runnable
    from sfhpc.rundir import new_run_dir

    recipe, cluster, plan = _load(args)
    check_runnable(recipe)
    executor_for(recipe, cluster, plan, Path("."))  # fails early, before a folder exists, without Slurm
    if args.resume:  # a new job in the run's own folder: its ranks continue from the newest checkpoint
        run_dir = resumable_in_new_job(Path(args.resume), recipe)
    else:
        run_dir = new_run_dir(recipe.output_dir, recipe.name, group=recipe.output_group)
    submission = submit(recipe, cluster, plan, run_dir)
    print(plan.describe())
    print(f"submitted job {submission.job_id}; run folder {run_dir}")
    if recipe.attach is not None:
        from sfhpc.launch.attach import AttachRequest, submit_attach

        job, pool = submit_attach(recipe, cluster, AttachRequest.of(recipe, str(submission.job_id)), run_dir)
        print(f"submitted attach job {job}: {recipe.attach.rollout} rollout worker(s) on pool '{pool.name}', "
              f"starting once job {submission.job_id} has")
    if not args.wait:
        print(f"follow it with: sfhpc status {submission.job_id} / sfhpc logs {submission.job_id}")
        return 0
    return _wait(submission.job_id, run_dir, args.timeout)


def cmd_probe(args: argparse.Namespace) -> int:
    """The recipe's ranks started as `launch` (or, with --local, `run`) would start them, each saying where
    it is: the launch report, gathered over the MPI world, in the run folder. No RL, so no task."""
    from sfhpc.rundir import new_run_dir

    if args.local:
        from sfhpc.launch.local import run_local
        from sfhpc.plan.local_map import local_cluster_map

        recipe = load_recipe(args.recipe)
        plan = resolve(recipe, local_cluster_map(recipe))
        run_dir = new_run_dir(recipe.output_dir, recipe.name, group=recipe.output_group)
        print(plan.describe())
        print(f"run folder {run_dir}", flush=True)
        return run_local(plan, args.recipe, None, run_dir, probe=True, plan_shown=True)
    from sfhpc.launch.slurm_launch import executor_for, submit

    recipe, cluster, plan = _load(args)
    executor_for(recipe, cluster, plan, Path("."))  # fails early, before a folder exists, without Slurm
    run_dir = new_run_dir(recipe.output_dir, recipe.name, group=recipe.output_group)
    submission = submit(recipe, cluster, plan, run_dir, probe=True)
    print(plan.describe())
    print(f"submitted job {submission.job_id}; run folder {run_dir}")
    return _wait(submission.job_id, run_dir, args.timeout) if args.wait else 0


def _wait(job_id: str, run_dir: Path, timeout: float, poll_s: float = 1.0) -> int:
    """Follow the job across requeues until its latest run is over; then print its log."""
    from sfhpc.launch.jobs import JobFollower, job_status, live_job

    follower = JobFollower(job_id)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = live_job(job_id)
        accounted = None
        if live is None:  # slurmctld has forgotten the job: ask accounting
            try:
                accounted = job_status(job_id).state
            except SfhpcError:
                accounted = None  # accounting lags a moment behind sbatch
        for line in follower.observe(live, accounted):
            print(line, flush=True)
        if follower.final is not None:
            log = RunPaths(run_dir).slurm_log(job_id)
            if log.exists():
                print(log.read_text(encoding="utf-8", errors="replace"), end="")
            return 0 if follower.succeeded else 1
        time.sleep(poll_s)
    raise SfhpcError(f"job {job_id} did not finish within {timeout:.0f} s; it keeps running: "
                     f"sfhpc status {job_id}, or sfhpc cancel {job_id}")


def cmd_run(args: argparse.Namespace) -> int:
    from sfhpc.launch.local import run_local
    from sfhpc.plan.local_map import local_cluster_map
    from sfhpc.rl.program import check_runnable
    from sfhpc.rundir import new_run_dir

    overrides = parse_overrides(args.set)
    recipe = load_recipe(args.recipe, overrides)
    check_runnable(recipe)
    cluster = load_cluster_map(args.cluster) if args.cluster else local_cluster_map(recipe)
    plan = resolve(recipe, cluster)
    if args.resume:
        from sfhpc.rl.resume import check_resumable

        run_dir, _ = check_resumable(Path(args.resume), recipe)
    else:
        run_dir = new_run_dir(recipe.output_dir, recipe.name, group=recipe.output_group)
    print(plan.describe())
    print(f"run folder {run_dir}", flush=True)
    code = run_local(plan, args.recipe, args.cluster, run_dir, verbose=args.verbose, plan_shown=True,
                     overrides=overrides)
    return _run_outcome(run_dir, code, verbose=args.verbose)


def cmd_eval(args: argparse.Namespace) -> int:
    from sfhpc.launch.local import run_local
    from sfhpc.plan.local_map import local_cluster_map
    from sfhpc.rl import offline_eval
    from sfhpc.rl.program import check_runnable
    from sfhpc.rundir import new_run_dir

    run = Path(args.run)
    evaluation = offline_eval.prepare(
        run, step=args.step, data=Path(args.data) if args.data else None,
        recipe_path=Path(args.recipe) if args.recipe else None, samples=args.samples,
        temperature=args.temperature, problems=args.problems, extra=parse_overrides(args.set))
    recipe = evaluation.recipe
    check_runnable(recipe)
    plan = resolve(recipe, load_cluster_map(args.cluster) if args.cluster else local_cluster_map(recipe))
    eval_dir = new_run_dir(recipe.output_dir, recipe.name, group=recipe.output_group)
    print(plan.describe())
    print(f"evaluating step {evaluation.step} ({evaluation.checkpoint}) in {eval_dir}", flush=True)
    code = _run_outcome(eval_dir, run_local(plan, str(evaluation.recipe_path), args.cluster, eval_dir,
                                            verbose=args.verbose, plan_shown=True, overrides=evaluation.overrides),
                        verbose=args.verbose)
    if code == 0:
        print(offline_eval.summary(evaluation, run.absolute(), eval_dir))
    return code


# A run that stopped at a signal's safe point exits with this code (EX_TEMPFAIL): not done, resumable.
STOPPED_EXIT = 75


def _run_outcome(run_dir: Path, code: int, verbose: bool = False) -> int:
    """The exit code of ``sfhpc run``: mpiexec's (a failed rank's own, which said why in its line), 75 for a
    run stopped at a signal's safe point; a rank ended by a signal has no line of its own, so one is said."""
    from sfhpc.data.run_log import last_event

    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = "unknown"
        which = "" if verbose else "; `sfhpc run --verbose` has mpiexec name the rank"
        print(f"sfhpc: error: a rank of the run was ended by signal {code - 128} ({name}): killed, out of memory? "
              f"its log is in {run_dir / 'logs'}{which}", file=sys.stderr)
        return code
    event = last_event(run_dir)
    if code == 0 and event is not None and event["event"] == "stopped":
        return STOPPED_EXIT
    return code


def cmd_status(args: argparse.Namespace) -> int:
    from sfhpc.launch.jobs import format_status, job_restarts, job_status
    from sfhpc.rl.live_status import read_live_status
    from sfhpc.rundir import find_run_dir

    status = job_status(args.job)
    run_dir = find_run_dir(args.output_dir, args.job)
    live = read_live_status(run_dir) if run_dir is not None else None
    print(format_status(status, run_dir, job_restarts(args.job), live))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from sfhpc.launch.jobs import job_logs

    print(job_logs(args.job, args.output_dir, args.rank), end="")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from sfhpc.launch.jobs import cancel_job

    cancel_job(args.job)
    print(f"cancelled job {args.job}")
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    """A Slurm job of rollout workers that join a running run (`sfhpc.launch.attach`)."""
    from sfhpc.launch.attach import AttachRequest, submit_attach
    from sfhpc.rundir import find_run_dir, recorded_recipe

    run_dir = Path(args.run).absolute() if Path(args.run).is_dir() else find_run_dir(args.output_dir, args.run)
    recorded = recorded_recipe(run_dir) if run_dir is not None else None
    if run_dir is None or recorded is None:
        raise SfhpcError(f"{args.run} is neither an RL run's folder nor a job of one in {args.output_dir}/jobs.tsv")
    recipe = load_recipe(recorded[0], recorded[1])
    if recipe.attach_refusal is not None:
        raise SfhpcError(f"the run in {run_dir} takes no rollout workers of other jobs: {recipe.attach_refusal}")
    request = AttachRequest(args.rollout, args.partition, args.qos, args.time)
    job, pool = submit_attach(recipe, _cluster_map(args.cluster), request, run_dir, dry_run=args.dry_run)
    if args.dry_run:
        print(job, end="")
        return 0
    print(f"submitted attach job {job}: {args.rollout} rollout worker(s) on pool '{pool.name}' (partition "
          f"{pool.partition}) join the run in {run_dir} as they start; sfhpc cancel {job} takes them back")
    return 0


def cmd_traj_summary(args: argparse.Namespace) -> int:
    from sfhpc.analysis import open_run
    from sfhpc.analysis.summary import run_finished, summarize, update_line

    if args.interval <= 0:
        raise SfhpcError(f"--interval {args.interval:g}: give a number of seconds above 0")
    with open_run(args.store) as run:
        summary = summarize(run)
        print(printable(summary.format()), flush=True)
        if not args.follow:
            return 0
        print(f"following {run.path} every {args.interval:g} s (Ctrl-C ends)", flush=True)
        # Ctrl-C sets a flag, checked between reads: raised inside an HDF5 read, KeyboardInterrupt could leave
        # h5py's lock held and the file's close waiting on it for good.
        stopped: list[int] = []
        earlier = signal.signal(signal.SIGINT, lambda signum, _frame: stopped.append(signum))
        try:
            while not stopped and not run_finished(run.folder):
                wake = time.monotonic() + args.interval
                while not stopped and time.monotonic() < wake:
                    time.sleep(min(FOLLOW_TICK_S, max(0.0, wake - time.monotonic())))
                if not stopped and run.refresh():
                    summary, previous = summarize(run), summary
                    print(printable(update_line(run, previous, summary)), flush=True)
        finally:
            signal.signal(signal.SIGINT, earlier)
        if stopped:
            print("stopped following", flush=True)
            return 0
        run.refresh()
        print(f"the run finished\n\n{printable(summarize(run).format())}", flush=True)
    return 0


def cmd_traj_export(args: argparse.Namespace) -> int:
    from sfhpc.analysis import open_run
    from sfhpc.analysis.export import write_frame

    out = Path(args.out)
    if out.exists():
        raise SfhpcError(f"{out} exists; choose another --out (nothing was written)")
    if not out.parent.is_dir():
        raise SfhpcError(f"{out.parent}: no such folder for --out")
    with open_run(args.store) as run:  # the frame is computed over whole tables: seconds for a million
        df = run.trajectories()
        fmt = args.format or {".parquet": "parquet", ".jsonl": "jsonl"}.get(out.suffix.lower(), "csv")
        count = write_frame(df, out, fmt)
    print(f"wrote {count:,} trajectories to {out} ({fmt})")
    return 0


def cmd_traj_show(args: argparse.Namespace) -> int:
    from sfhpc.analysis import open_run
    from sfhpc.analysis.conversation import format_conversation

    with open_run(args.store) as run:
        trajectory = run.trajectory(args.id)
        print(printable(format_conversation(run, trajectory, run.consumed_by(args.id), tokens=args.tokens)))
    return 0


def cmd_traj_plot(args: argparse.Namespace) -> int:
    from sfhpc.analysis import locate_store, open_run
    from sfhpc.analysis.plots import PlotData, draw

    path = locate_store(args.store)
    out = _new_file(Path(args.out) if args.out else path.parent / "trajectories.png")
    with open_run(path) as run:
        data = PlotData.of(run)
    try:
        with out.open("xb") as handle:  # "x": never overwrite, even a file that appeared meanwhile
            panels = draw(data, handle, title=str(path.parent.name))
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    print(f"wrote {out} ({', '.join(panels)})")
    return 0


def cmd_traj_report(args: argparse.Namespace) -> int:
    from sfhpc.analysis import locate_store, open_run
    from sfhpc.analysis.report import write_report

    path = locate_store(args.store)
    out = _new_file(Path(args.out) if args.out else path.parent / "report.html")
    with open_run(path) as run:
        write_report(run, out)
    print(f"wrote {out}")
    return 0


def cmd_traj_trace(args: argparse.Namespace) -> int:
    import json

    from sfhpc.analysis import locate_store, open_run
    from sfhpc.analysis.trace import parse_steps, run_trace

    try:
        steps = parse_steps(args.steps) if args.steps else None
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    except ValueError:
        raise SfhpcError(f"--steps takes A:B and --ranks 0,2,...; found {args.steps!r}, {args.ranks!r}") from None
    path = locate_store(args.store)
    out = _new_file(Path(args.out) if args.out else path.parent / "trace.json")
    with open_run(path) as run:
        if not run.store.records_timeline:
            raise SfhpcError(f"{path}: this store records no timeline (written by an earlier sfhpc)")
        trace = run_trace(path.parent, run.timeline(), steps=steps, ranks=ranks)
    try:
        with out.open("x", encoding="utf-8") as handle:  # "x": never overwrite, even a file that appeared meanwhile
            json.dump(trace, handle)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    tracks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    print(f"wrote {out}: {len(trace['traceEvents']):,} events, {len(tracks)} rank track(s); open it in "
          "https://ui.perfetto.dev or chrome://tracing")
    return 0


def cmd_traj_compare(args: argparse.Namespace) -> int:
    from sfhpc.analysis import open_run
    from sfhpc.analysis.compare import compare, plot_rewards

    out = _new_file(Path(args.out)) if args.out else None
    with open_run(args.a) as a, open_run(args.b) as b:
        comparison = compare(a, b)
    print(printable(comparison.format()))
    if out is not None:
        plot_rewards(comparison, out)
        print(f"wrote {out}")
    return 0


def _new_file(out: Path) -> Path:
    """`out`, a file to create: one line and nothing written when it exists or its folder does not."""
    if out.exists():
        raise SfhpcError(f"{out} exists; choose another --out (nothing was written)")
    if not out.parent.is_dir():
        raise SfhpcError(f"{out.parent}: no such folder for --out")
    return out


def cmd_tags_show(args: argparse.Namespace) -> int:
    from sfhpc.admin.tags import show_tags

    print(show_tags(load_cluster_map(args.map)))
    return 0


def cmd_tags_check(args: argparse.Namespace) -> int:
    from sfhpc.admin.live_cluster import query_live_cluster
    from sfhpc.admin.site_check import check_site
    from sfhpc.admin.tags import check_tags, format_check

    cluster = load_cluster_map(args.map)
    launch = load_recipe(args.recipe).launch if args.recipe else None
    live = query_live_cluster()
    problems = check_tags(cluster, live)
    site = check_site(cluster, live, launch)
    print(format_check(cluster, live, problems, site))
    return 1 if problems or site else 0


def available_benchmarks() -> list[str]:
    """Modules of sfhpc.bench with a ``main(argv) -> int`` (each one figure of merit). Read from their source,
    not imported: one of them imports torch, which would cost every ``sfhpc bench`` seconds before it can
    even refuse a bad option."""
    import pkgutil
    import re
    from pathlib import Path

    import sfhpc.bench

    folder = Path(sfhpc.bench.__path__[0])
    return sorted(info.name for info in pkgutil.iter_modules([str(folder)]) if not info.name.startswith("_")
                  and re.search(r"^def main\(", (folder / f"{info.name}.py").read_text(encoding="utf-8"), re.M))


def cmd_export(args: argparse.Namespace) -> int:
    from sfhpc.rl.export import export

    out = export(args.run, args.out, step=args.step, dtype=args.dtype, adapter=args.adapter)
    info = json.loads((out / "sfhpc_export.json").read_text())
    what = "the LoRA adapter" if args.adapter else "step"
    print(f"exported {what} {info['step']} (policy version {info['policy_version']}, {info['checkpoint']}) of "
          f"{args.run} to {out}: {', '.join(info['files'])} in {info['dtype']}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    names = available_benchmarks()
    if args.name != "all" and args.name not in names:
        raise SfhpcError(f"unknown benchmark '{args.name}' (known: all, {', '.join(names)})")
    worst = 0
    for name in names if args.name == "all" else [args.name]:
        print(f"== sfhpc bench {name}", flush=True)
        worst = max(worst, int(importlib.import_module(f"sfhpc.bench.{name}").main(args.options)))
    return worst


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sfhpc", description="Slurm-native RL for language-model agents.")
    parser.add_argument("--version", action="version", version=f"sfhpc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def recipe_command(name: str, func, help: str, cluster_default: str | None = "map") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("recipe", help="recipe YAML file")
        default = _default_map() if cluster_default == "map" else None
        p.add_argument("--cluster", default=default, metavar="MAP",
                       help=f"cluster tag map (default: $SFHPC_CLUSTER_MAP or {DEFAULT_CLUSTER_MAP})"
                       if cluster_default == "map" else "cluster tag map (default: this machine alone)")
        p.set_defaults(func=func)
        return p

    p = recipe_command("launch", cmd_launch, "submit a recipe as one heterogeneous Slurm job")
    p.add_argument("--wait", action="store_true", help="wait for the job to end and print its output")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait with --wait (default 3600)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a run whose job ended (cancelled, out of time or requeues) in a new job, in its own "
                        "folder, from its latest complete checkpoint")
    p = recipe_command("render", cmd_render, "print the batch script of a recipe without submitting it")
    p.add_argument("--template", action="store_true",
                   help="a reusable template: `sbatch SCRIPT RECIPE.yaml` runs any recipe of this shape")
    p = recipe_command("run", cmd_run, "run a recipe on this machine with mpiexec (no Slurm)", cluster_default=None)
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped run from its latest complete checkpoint, in its own folder")
    p.add_argument("--verbose", action="store_true",
                   help="the engine's and libraries' INFO lines (vLLM's) and mpiexec's own messages on the console "
                        "too (else they go to the run's logs/rank-NNN.log)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe key over the file's, as YAML (budgets.steps=10, evaluation.samples=4, "
                        "model.path=null); repeat for several")
    recipe_command("plan", cmd_plan, "show where every role and rank of a recipe would run")
    recipe_command("check", cmd_check, "every check `run` (or, with --cluster, `launch`) makes before it starts, "
                                       "one line per problem; silent when there is none", cluster_default=None)
    p = recipe_command("probe", cmd_probe, "start a recipe's ranks and prove where they run (the launch report), "
                                           "without RL")
    p.add_argument("--local", action="store_true", help="on this machine with mpiexec, as `sfhpc run` does")
    p.add_argument("--wait", action="store_true", help="wait for the job to end and print its output")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait with --wait (default 600)")

    for name, func, help in (("status", cmd_status, "state of a job and of each of its components"),
                             ("logs", cmd_logs, "output of a job (all ranks, labelled), or of one rank"),
                             ("cancel", cmd_cancel, "cancel a job")):
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("job", help="Slurm job id")
        if name != "cancel":
            p.add_argument("--output-dir", default="runs", help="the recipe's output_dir (default: runs)")
        if name == "logs":
            p.add_argument("--rank", type=int, help="show this rank's own log file")
        p.set_defaults(func=func)

    p = sub.add_parser("attach", help="submit a job of rollout workers that join a running run (backfill, a "
                                      "preemptible QOS) and leave it when their job ends",
                       description="submit a job of rollout workers that join a running run and leave it when their "
                                   "job ends (preemption, time limit, scancel): their episodes continue elsewhere")
    p.add_argument("run", help="the run's folder, or the Slurm job id of its run")
    p.add_argument("--rollout", type=int, required=True, metavar="N", help="rollout workers (one task each)")
    p.add_argument("--partition", help="the partition to run them on (default: the first pool of the map that "
                                       "offers the recipe's rollout tags)")
    p.add_argument("--qos", help="the job's QOS (a preemptible one, for capacity the run may lose)")
    p.add_argument("--time", type=int, metavar="MIN", help="the job's time limit (default: the recipe's "
                                                            "launch.time_minutes)")
    p.add_argument("--cluster", default=_default_map(), metavar="MAP",
                   help=f"cluster tag map (default: $SFHPC_CLUSTER_MAP or {DEFAULT_CLUSTER_MAP})")
    p.add_argument("--output-dir", default="runs", help="where a job id is looked up (default: runs)")
    p.add_argument("--dry-run", action="store_true", help="print the batch script instead of submitting it")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("export", help="a run's trained policy as a Hugging Face folder",
                       description="Write the policy of a run's newest checkpoint (or of --step) as a Hugging Face "
                                   "folder (safetensors, config, tokenizer, chat template) that transformers and "
                                   "vLLM load.")
    p.add_argument("run", help="the run folder")
    p.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="the weights' dtype (default bfloat16, as the engines serve them)")
    p.add_argument("--adapter", action="store_true",
                   help="a run with model.lora: write its adapter as a PEFT adapter folder (adapter_config.json, "
                        "adapter_model.safetensors) instead of the merged model")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="evaluate a run's checkpoint on held-out problems, on this machine",
                       description="Play held-out problems with the policy of a run's newest checkpoint (or of "
                                   "--step), as the run's own recipe plays its evaluations, and print pass@1, mean@k "
                                   "and pass@k. The replies and scores go to a run folder under RUN/evaluations/.")
    p.add_argument("run", help="the run folder")
    p.add_argument("--data", help="held-out rows (.jsonl or .parquet) with the task's prompt and answer keys "
                                  "(default: the recipe's evaluation.path)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--samples", type=int, default=None, help="replies per problem: k of pass@k (default: the "
                                                              "recipe's evaluation.samples, else 1)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy; default: the "
                                                                     "recipe's evaluation.temperature, else 0)")
    p.add_argument("--problems", type=int, default=None, help="the first N problems (default: the recipe's "
                                                               "evaluation.problems, else all)")
    p.add_argument("--recipe", help="the recipe the run was started with (default: the one the run noted)")
    p.add_argument("--cluster", default=None, metavar="MAP", help="cluster tag map (default: this machine alone)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe key over the file's")
    p.add_argument("--verbose", action="store_true", help="the libraries' INFO lines on the console too")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="benchmarks: the figures of merit, one command each",
                       description="Run one benchmark (or all); options after the name go to the benchmark.")
    p.add_argument("name", help="benchmark name, or 'all'")
    p.add_argument("options", nargs=argparse.REMAINDER, help="options of the benchmark (see NAME --help)")
    p.set_defaults(func=cmd_bench)

    traj = sub.add_parser("traj", help="a run's trajectory store (for analysts)").add_subparsers(
        dest="traj_command", required=True, metavar="SUBCOMMAND")
    p = traj.add_parser("summary", help="counts by status, reward and length per step range, staleness, partial "
                        "rollouts", description="counts by status, reward and length per step range, staleness "
                        "distribution, partial rollouts and how many versions wrote them")
    p.add_argument("store", help="a run folder, or its trajectories.h5 (may still be written)")
    p.add_argument("--follow", action="store_true",
                   help="keep reading a live run: a line per change, until it finishes (or Ctrl-C)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between reads with --follow (default 5)")
    p.set_defaults(func=cmd_traj_summary)
    p = traj.add_parser("export", help="one row per trajectory (CSV, Parquet or JSON lines)",
                        description="one row per trajectory (CSV, Parquet or JSON lines)")
    p.add_argument("store", help="a run folder, or its trajectories.h5 (may still be written)")
    p.add_argument("--out", required=True, help="file to create (an existing file is never overwritten)")
    p.add_argument("--format", choices=("csv", "parquet", "jsonl"), default=None,
                   help="csv (today's columns), parquet (typed, more columns) or jsonl (as parquet); default: from "
                        "--out's suffix (.parquet, .jsonl), else csv")
    p.set_defaults(func=cmd_traj_export)
    p = traj.add_parser("show", help="one trajectory as a conversation: roles, text, policy versions, cuts",
                        description="one trajectory as a conversation: roles, text, policy versions, cuts")
    p.add_argument("store", help="a run folder, or its trajectories.h5 (may still be written)")
    p.add_argument("id", help="the trajectory id (sfhpc traj export lists them)")
    p.add_argument("--tokens", action="store_true", help="also a row per token: id, text, logprob, version")
    p.set_defaults(func=cmd_traj_show)
    p = traj.add_parser("plot", help="reward and length over the steps, staleness, tokens per policy version",
                        description="reward and reply length over the training steps, staleness histogram, "
                        "tokens per policy version (one PNG)")
    p.add_argument("store", help="a run folder, or its trajectories.h5 (may still be written)")
    p.add_argument("--out", help="PNG file to create (default: trajectories.png beside the store)")
    p.set_defaults(func=cmd_traj_plot)
    p = traj.add_parser("report", help="one self-contained HTML file: tables, plots, sample conversations",
                        description="one self-contained HTML file: tables, plots, sample conversations "
                        "(best and worst reward)")
    p.add_argument("store", help="a run folder, or its trajectories.h5 (may still be written)")
    p.add_argument("-o", "--out", help="HTML file to create (default: report.html beside the store)")
    p.set_defaults(func=cmd_traj_report)
    p = traj.add_parser("trace", help="the ranks' timeline as a Chrome trace (Perfetto, chrome://tracing)",
                        description="the ranks' timeline as a Chrome trace event file that Perfetto and "
                        "chrome://tracing open: a track per rank (generating, training, syncing, lent, idle), "
                        "weight versions, reclaims and checkpoints as events, per-step counters")
    p.add_argument("store", help="a run folder, or its trajectories.h5 (may still be written)")
    p.add_argument("--out", help="JSON file to create (default: trace.json beside the store; never overwritten)")
    p.add_argument("--steps", help="only these steps, A:B inclusive (A: or :B open on one side)")
    p.add_argument("--ranks", help="only these ranks, comma-separated")
    p.set_defaults(func=cmd_traj_trace)
    p = traj.add_parser("compare", help="two runs side by side: throughput, bubble fraction, reward curves",
                        description="two runs side by side: throughput, bubble fraction, reward curves")
    p.add_argument("a", help="a run folder, or its trajectories.h5")
    p.add_argument("b", help="another run folder, or its trajectories.h5")
    p.add_argument("--out", help="also draw both reward curves into this PNG file (created, never overwritten)")
    p.set_defaults(func=cmd_traj_compare)

    tags = sub.add_parser("tags", help="cluster tag maps (for admins)").add_subparsers(
        dest="tags_command", required=True, metavar="SUBCOMMAND")
    for name, func, help in (("show", cmd_tags_show, "table of tags -> partitions, nodes, GPUs"),
                             ("check", cmd_tags_check, "compare a tag map with the live cluster, and check the "
                                                       "site's Slurm settings sfhpc needs")):
        p = tags.add_parser(name, help=help, description=help)
        p.add_argument("map", help="cluster tag map YAML file")
        if name == "check":
            p.add_argument("--recipe", help="also check what this recipe's launch section needs (its MPI plugin, "
                                            "its signal_grace_s against the grace a preemption gives)")
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SfhpcError as exc:
        # One line whatever it quotes (an id a client chose, text from a store): its controls escaped.
        print(f"sfhpc: error: {printable(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("sfhpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
