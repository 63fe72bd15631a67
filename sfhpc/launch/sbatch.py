"""sbatch script text, from one pure function.

`render_sbatch` turns an `SbatchSpec` into the exact text of a batch script: flags sorted within each
component, values shell-quoted, ``snake_case`` keys as ``--kebab-case`` flags, one ``#SBATCH hetjob``
line between components, and one ``srun`` that spans every component (``--het-group=0,1,...``) so that
all ranks share one MPI world. Agent hosts (an ``agents`` role, the last component) are no ranks: a step of
their own starts them in the background before that ``srun``, so that losing one ends neither the world nor
the job. The same inputs always give the same bytes (golden-file tests).
`spec_for_plan` builds the spec of a resolved recipe.

Nothing a recipe or map holds can break out of its place: flag values are shell-quoted, comment lines
have their control characters escaped, and ``#SBATCH`` lines refuse line breaks (the config loader
already refused them; only ``setup`` is shell text, on purpose).

Signals. Slurm sends some signals to the batch shell alone (``USR1`` from ``--signal=B:USR1@N`` ahead
of the time limit, ``scancel -b --signal``) and ``TERM`` to the shell and every step on a requeue or a
preemption. If the shell died of ``TERM`` the job would end at once and the ranks would lose their
KillWait seconds to checkpoint. So with ``exec_step`` the shell hands its process over to the step
(``exec``): the step guard then *is* the batch shell, receives those signals, passes them on to srun
(which passes them on to the ranks) and keeps waiting; the job's exit status is srun's. A shell that
kept running beside the step would have to ``wait`` in a loop that each trapped signal cuts short, and
bash 5.2 loses the step's exit status when a signal arrives as the step ends (measured under a burst of
signals: the script exited 255 or 128+N instead of the step's status).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping

from sfhpc.config.recipe import Recipe
from sfhpc.config.schema import is_control
from sfhpc.plan.launch_plan import Component, LaunchPlan

FlagValue = str | int | bool | None


@dataclasses.dataclass(frozen=True)
class SbatchSpec:
    """Everything a batch script holds. ``command`` is shell text, used as it is after srun."""

    components: tuple[Mapping[str, FlagValue], ...]
    command: str
    srun_flags: Mapping[str, FlagValue] = dataclasses.field(default_factory=dict)
    extra_directives: tuple[str, ...] = ()    # verbatim "#SBATCH <text>" lines of component 0
    setup: tuple[str, ...] = ()               # shell lines before srun
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)
    header: tuple[str, ...] = ()              # comment lines under the shebang
    guard: str | None = None                  # shell words srun runs under (sfhpc.launch.step_guard)
    exec_step: bool = False                   # the step replaces the shell: it gets the shell's signals
    agent_hosts: str | None = None            # shell text the last component runs, outside the MPI world
    step_note: str = "one step spans every component: one MPI world"  # the comment above the step


def flag(key: str, value: FlagValue) -> str | None:
    """``("cpus_per_task", 2)`` -> ``--cpus-per-task=2``; True -> bare flag; None/False -> omitted."""
    if value is None or value is False:
        return None
    name = "--" + key.replace("_", "-")
    return name if value is True else f"{name}={shlex.quote(str(value))}"


def _flags(flags: Mapping[str, FlagValue]) -> list[str]:
    return [f for f in (flag(k, flags[k]) for k in sorted(flags)) if f is not None]


def comment_text(text: str) -> str:
    """`text` made safe for one comment line: control characters become ``\\uXXXX``, so a newline in a
    name can never end the comment and start a shell line."""
    return "".join(f"\\u{ord(c):04x}" if is_control(c) else c for c in text)


def double_quoted(text: str) -> str:
    """`text` escaped for use inside ``"${VAR:-...}"`` (the characters special there: \\ $ ` " })."""
    return "".join("\\" + c if c in '\\$`"}' else c for c in text)


def _directive(text: str) -> str:
    if any(is_control(c) for c in text):
        raise ValueError(f"an #SBATCH line must be one plain line, found {text!r}")
    return f"#SBATCH {text}"


def render_sbatch(spec: SbatchSpec) -> str:
    """The batch script text of `spec` (pure: no clock, no environment, no file system)."""
    if not spec.components:
        raise ValueError("an sbatch script needs at least one component")
    lines = ["#!/bin/bash"]
    lines += [f"# {comment_text(h)}" if h else "#" for h in spec.header]
    for index, component in enumerate(spec.components):
        if index > 0:
            lines.append("#SBATCH hetjob")
        lines += [_directive(f) for f in _flags(component)]
        if index == 0:
            lines += [_directive(d) for d in spec.extra_directives]
    lines += ["", "set -euo pipefail"]
    if spec.setup:
        lines += ["", "# setup", *spec.setup]
    if spec.environment:
        lines.append("")
        for key, value in sorted(spec.environment.items()):
            if not key.isidentifier():
                raise ValueError(f"{key!r} is not an environment variable name")
            lines.append(f"export {key}={shlex.quote(value)}")
    world = len(spec.components) - (spec.agent_hosts is not None)
    if spec.agent_hosts is not None:
        if world < 1:
            raise ValueError("agent hosts need a component of their own after the ranks'")
        lines += ["", f"# agent hosts (component {world}): a step of their own, outside the MPI world, so that losing "
                      "one ends nothing else", f"srun --het-group={world} --mpi=none {spec.agent_hosts} &"]
    srun = ["srun"]
    if len(spec.components) > 1:
        srun.append("--het-group=" + ",".join(str(i) for i in range(world)))
    srun += _flags(spec.srun_flags)
    step = " ".join(srun) + " " + spec.command
    lines += ["", f"# {comment_text(spec.step_note)}"]
    if spec.guard:
        lines.append("# (the guard ends srun if it outlives every rank: a Slurm 22.05 mpi/pmix hang)")
        step = f"{spec.guard} {step}"
    if spec.exec_step:
        lines += ["# exec: the guard takes the batch shell's place, so the signals Slurm sends the shell (USR1",
                  "# ahead of the time limit, scancel -b --signal, the TERM of a requeue or preemption) reach it;",
                  "# it passes them on to srun and keeps waiting. The job's exit status is the step's.",
                  f"exec {step}"]
    else:
        lines.append(step)
    lines.append("")
    return "\n".join(lines)


def component_flags(component: Component, time_minutes: int) -> dict[str, FlagValue]:
    """sbatch flags that place one component on its pool."""
    return {
        "partition": component.pool.partition,
        "constraint": component.pool.constraint,
        "nodes": component.nodes,
        "ntasks": component.num_tasks,
        "ntasks_per_node": component.tasks_per_node,
        "cpus_per_task": component.cpus_per_task,
        "time": time_minutes,
        **gpu_flags(component),
    }


def gpu_flags(component: Component) -> dict[str, FlagValue]:
    """One GPU per rank. Where every task of the component uses GPUs, Slurm binds each to its own
    (``--gpus-per-task`` with ``--gpu-bind=single:1``: one task per GPU). A component that also holds
    GPU-less ranks (the controller placed with the trainers) cannot ask per task, since every task of a
    component gets the same count: it asks ``--gpus-per-node`` and each GPU rank narrows
    ``CUDA_VISIBLE_DEVICES`` to its own at start (`sfhpc.runtime.gpu_binding`)."""
    if not component.gpus_per_node:
        return {}
    if component.tasks_per_node is None:
        return {"gpus_per_node": component.gpus_per_node}
    per_task = component.gpus_per_node // component.tasks_per_node
    return {"gpus_per_task": per_task, "gpu_bind": "single:1" if per_task == 1 else None}


def spec_for_plan(plan: LaunchPlan, recipe: Recipe, command: str, *, output: str | None, python: str,
                  setup: tuple[str, ...] = (), environment: Mapping[str, str] | None = None,
                  header: tuple[str, ...] = (), agent_hosts: str | None = None) -> SbatchSpec:
    """The batch script of a resolved recipe; `command` is what every rank runs, `python` (shell words)
    the interpreter the batch script runs the step guard with, `agent_hosts` what every task of the agents
    role runs (a plan with one needs it)."""
    if (plan.agent_hosts is None) != (agent_hosts is None):
        raise ValueError("a plan with an agents role needs the agent hosts' command, and only such a plan")
    launch = recipe.launch
    components = [component_flags(c, launch.time_minutes) for c in plan.components]
    components[0].update(
        job_name=launch.job_name or f"sfhpc-{recipe.name}",
        account=launch.account,
        qos=launch.qos,
        output=output,
        # A requeued job appends to its log instead of starting it afresh (sbatch -o on a template too).
        open_mode="append" if output or launch.requeue else None,
        requeue=launch.requeue,
        no_requeue=not launch.requeue,
        # Ahead of the time limit the batch shell gets USR1 and passes it on: the ranks checkpoint.
        signal=f"B:USR1@{launch.signal_grace_s}" if launch.requeue else None,
    )
    guard = f"{python} -m sfhpc.launch.step_guard --ranks {plan.world_size}"
    if launch.requeue:
        guard += f" --requeue-on-failure {launch.max_restarts}"
    return SbatchSpec(
        components=tuple(components),
        command=command,
        # --label prefixes each output line with the world rank; --kill-on-bad-exit ends the whole
        # step when one rank fails, so a crashed rank cannot leave the others blocked in MPI.
        srun_flags={"mpi": launch.mpi, "label": True, "kill_on_bad_exit": 1},
        extra_directives=launch.extra_sbatch,
        setup=(*launch.setup, *setup),
        environment=dict(environment or {}),
        header=header,
        guard=f"{guard} --",
        exec_step=True,
        agent_hosts=agent_hosts,
    )
