"""One trajectory as a conversation a person reads (``sfhpc traj show``).

Every recorded segment in order, all branches: its role (prompt, user observation, assistant), its text
in the run's vocabulary, and for the policy's tokens which version(s) and engine wrote them. A
generation that a weight update or a restart cut (finish reason ``abort``) is marked where it was cut,
with the segment that continued it; a reply that several policy versions wrote says so. With
``tokens=True`` every token gets a row: id, its text, sampling logprob, policy version.
"""

from __future__ import annotations

from sfhpc.analysis.run import Run
from sfhpc.data.store import ConsumptionMark
from sfhpc.data.trajectory import NO_VERSION, Segment, SegmentKind, Trajectory, episode_of
from sfhpc.table import format_table
from sfhpc.terminal import one_line, printable

ROLES = {SegmentKind.PROMPT: "prompt", SegmentKind.OBSERVATION: "user observation",
         SegmentKind.GENERATED: "assistant"}
INDENT = "    "


def format_conversation(run: Run, trajectory: Trajectory, mark: ConsumptionMark | None = None, *,
                        tokens: bool = False) -> str:
    """The text ``sfhpc traj show`` prints; `mark`: the training step that consumed it, if one did."""
    lines = [_header(trajectory, mark)]
    branch = dict(trajectory.branch())
    numbers = trajectory.segment_turns()
    reply_of = {index: numbers[index] for index, segment in enumerate(trajectory.segments) if segment.generated}
    reply_versions = {numbers[span[-1][0]]: sorted({int(v) for i, used in span
                                                    for v in trajectory.segments[i].versions[:used]})
                      for span in trajectory.reply_spans()}
    for index, segment in enumerate(trajectory.segments):
        lines.append("")
        lines.append(_segment_line(trajectory, index, branch, reply_of, reply_versions))
        text = run.decode(segment.tokens)
        # Recorded text may hold terminal controls (a model's or an agent's): shown escaped, acting on nothing.
        lines += [INDENT + printable(line) for line in (text.splitlines() or ["(no tokens)"])]
        if segment.generated and segment.finish_reason == "abort":
            lines.append(INDENT + _cut_note(trajectory, index))
        if tokens and len(segment):
            lines.append(_token_table(run, segment))
    return "\n".join(lines)


def _header(trajectory: Trajectory, mark: ConsumptionMark | None) -> str:
    reward = "-" if trajectory.reward is None else f"{trajectory.reward:g}"
    parts = [f"trajectory {trajectory.id}", f"task {trajectory.task or '-'}", f"group {trajectory.group or '-'}",
             f"status {trajectory.status.value}", f"reward {reward}"]
    agent = trajectory.agent
    if agent is not None:  # one conversation of an episode of several agents
        parts[3:3] = [f"agent {agent}", f"episode {episode_of(trajectory.id, trajectory.metadata_json)}"]
    if trajectory.fail_reason:
        parts.append(f"failed: {trajectory.fail_reason}")
    lines = [one_line("  ".join(parts))]  # ids, task and group names may be a client's choice
    generated = trajectory.token_versions()[trajectory.generated_mask()]
    versions = sorted(set(generated.tolist()))
    by = f" by {'version' if len(versions) == 1 else 'versions'} {_join(versions)}" if versions else ""
    detail = (f"{_plural(len(trajectory.segments), 'segment')}; current branch "
              f"{_plural(trajectory.num_tokens, 'token')}, {trajectory.num_generated} generated{by}")
    if mark is not None:
        oldest = trajectory.oldest_version()
        stale = "" if oldest is None else f", staleness {mark.policy_version - oldest}"
        detail += f"; trained at step {mark.step} by version {mark.policy_version}{stale}"
    return "\n".join([*lines, detail])


def _segment_line(trajectory: Trajectory, index: int, branch: dict[int, int], reply_of: dict[int, int],
                  reply_versions: dict[int, list[int]]) -> str:
    segment = trajectory.segments[index]
    parts = [f"[{index}] {ROLES[segment.kind]}"]
    if index in reply_of:
        turn = reply_of[index]
        versions = reply_versions[turn]
        many = f", written by {len(versions)} versions: {_join(versions)}" if len(versions) > 1 else ""
        parts[0] += f" (reply {turn + 1}{many})"
    if segment.generated:
        versions = sorted(set(segment.versions.tolist()) - {NO_VERSION})
        if versions:
            parts.append(f"{'version' if len(versions) == 1 else 'versions'} {_join(versions)}")
        if segment.engine:
            parts.append(f"engine {segment.engine}")
    parts.append(_plural(len(segment), "token"))
    if segment.finish_reason:
        parts.append(f"finish {segment.finish_reason}")
    if index > 0 and _continues(trajectory, index):
        previous = trajectory.segments[index - 1]
        if previous.generated and previous.finish_reason == "abort" and segment.generated:
            parts.append(f"continues [{index - 1}] after its cut")
    elif index > 0:
        parent = trajectory.segments[segment.parent]
        parts.append(f"forks from [{segment.parent}] at token {segment.fork_at} of {len(parent)}")
    if index not in branch:
        parts.append("off the current branch")
    elif branch[index] < len(segment):
        parts.append(f"current branch uses its first {branch[index]}")
    return one_line("  ".join(parts))


def _continues(trajectory: Trajectory, index: int) -> bool:
    """Whether segment `index` simply extends the one before it (no fork)."""
    segment = trajectory.segments[index]
    return segment.parent == index - 1 and segment.fork_at == len(trajectory.segments[index - 1])


def _cut_note(trajectory: Trajectory, index: int) -> str:
    segment = trajectory.segments[index]
    after = [i for i in range(index + 1, len(trajectory.segments))
             if trajectory.segments[i].parent == index and trajectory.segments[i].fork_at == len(segment)
             and trajectory.segments[i].generated]
    where = f"continued by [{after[0]}]" if after else "not continued (yet)"
    return f"-- cut here (abort: a weight update or a restart stopped this generation); {where}"


def _token_table(run: Run, segment: Segment) -> str:
    rows = []
    for position, (token, logprob, version) in enumerate(zip(segment.tokens, segment.logprobs, segment.versions)):
        generated = version != NO_VERSION
        rows.append((str(position), str(int(token)), repr(run.token_text(int(token))),
                     f"{float(logprob):.4f}" if generated else "-", str(int(version)) if generated else "-"))
    return format_table(("pos", "id", "text", "logprob", "version"), rows, indent=INDENT)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _join(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)
