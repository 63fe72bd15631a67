"""The trajectory record: one task's interaction with the policy, token by token.

A trajectory is a *tree* of segments. The root is the prompt; each later segment continues its parent
(generated tokens, or a tool/environment observation). Branches share a prefix: a new turn whose prompt
diverges from what was recorded (a chat history re-tokenized differently, an agent that rolled back)
forks off where it diverges, and the tree keeps both. A segment may fork *inside* its parent
(`fork_at` < the parent's length), so no recorded segment is ever split or rewritten: the store stays
append-only.

The *current branch* is the path from the root to the last segment added; it is the full context the
policy saw for the next token, and the sequence a trainer trains on.

Every segment carries its token ids and, per token, the sampling logprob and the policy version that
produced it (-1 and 0.0 for tokens the policy did not generate). Per-token versions matter because a
partial rollout can be continued under newer weights in the middle of a turn.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

NO_VERSION = -1  # the version of a token the policy did not generate


class Status(enum.StrEnum):
    """Where a trajectory is in its life. Stored as a small integer: append members, never reorder."""

    RUNNING = "running"  # the agent is still interacting
    INTERRUPTED = "interrupted"  # generation stopped mid-way; the prefix is kept for a continuation
    FINISHED = "finished"  # complete and rewarded, waiting for a training step
    CONSUMED = "consumed"  # a training step used it
    STALE = "stale"  # its oldest token fell too far behind the policy; never trained on
    ABORTED = "aborted"  # given up by the run (e.g. another member of its GRPO group failed)
    FAILED = "failed"  # its agent or task raised or ran out of time (`fail_reason` says why); never trained on
    EVALUATED = "evaluated"  # an evaluation episode's, complete and rewarded (`sfhpc.rl.evaluation`); never trained on
    FILTERED = "filtered"  # complete and rewarded, its group without a signal (dynamic sampling); never trained on

    @property
    def code(self) -> int:
        return _STATUS_CODES[self]

    @classmethod
    def from_code(cls, code: int) -> Status:
        return _STATUS_LIST[code]

    @property
    def is_open(self) -> bool:
        """Whether the trajectory still takes tokens."""
        return self in (Status.RUNNING, Status.INTERRUPTED)


_STATUS_LIST = tuple(Status)
_STATUS_CODES = {s: i for i, s in enumerate(_STATUS_LIST)}


class SegmentKind(enum.StrEnum):
    """What a segment holds. Stored as a small integer: append members, never reorder."""

    PROMPT = "prompt"
    GENERATED = "generated"
    OBSERVATION = "observation"

    @property
    def code(self) -> int:
        return _KIND_CODES[self]

    @classmethod
    def from_code(cls, code: int) -> SegmentKind:
        return _KIND_LIST[code]


_KIND_LIST = tuple(SegmentKind)
_KIND_CODES = {k: i for i, k in enumerate(_KIND_LIST)}


def _frozen_array(values: Any, dtype: type) -> np.ndarray:
    array: np.ndarray = np.array(values, dtype=dtype).reshape(-1)  # a copy: the caller may reuse its buffer
    array.flags.writeable = False  # records are values: nobody edits a token after it is recorded
    return array


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """A run of tokens that continues the first `fork_at` tokens of segment `parent` (-1: the root)."""

    kind: SegmentKind
    parent: int
    fork_at: int
    tokens: np.ndarray  # int32
    # float32, 0.0 where the policy did not generate the token (None: all; filled in __post_init__)
    logprobs: np.ndarray = None  # type: ignore[assignment]
    # int32, NO_VERSION where the policy did not generate it (None: all; filled in __post_init__)
    versions: np.ndarray = None  # type: ignore[assignment]
    engine: str = ""  # the engine/rank that generated it
    t_start: float = 0.0  # wall-clock seconds (time.time())
    t_end: float = 0.0
    finish_reason: str = ""  # the engine's reason ("stop", "length", "abort"), empty for other kinds
    # The sampling the generated tokens were drawn with (None: unknown, or not a generated segment). A trainer
    # scores the tokens under the same temperature, so their logprobs compare with `logprobs`.
    temperature: float | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "kind", SegmentKind(self.kind))
        set_(self, "tokens", _frozen_array(self.tokens, np.int32))
        n = len(self.tokens)
        set_(self, "logprobs", _frozen_array(np.zeros(n) if self.logprobs is None else self.logprobs, np.float32))
        set_(self, "versions", _frozen_array(np.full(n, NO_VERSION) if self.versions is None else self.versions,
                                             np.int32))
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(f"segment has {n} tokens but {len(self.logprobs)} logprobs and "
                             f"{len(self.versions)} versions")
        if self.kind is not SegmentKind.GENERATED and n and (self.versions != NO_VERSION).any():
            raise ValueError(f"a {self.kind} segment holds no generated tokens, so every version must be -1")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is not None:  # NaN is how the store writes "unknown": it reads back as None
                set_(self, name, None if math.isnan(value) else float(value))

    @classmethod
    def of(cls, kind: SegmentKind, parent: int, fork_at: int, tokens: Sequence[int] | np.ndarray, *,
           logprobs: Sequence[float] | np.ndarray | None = None,
           versions: int | Sequence[int] | np.ndarray | None = None,
           engine: str = "", t_start: float = 0.0, t_end: float = 0.0, finish_reason: str = "",
           temperature: float | None = None, top_p: float | None = None) -> Segment:
        """Build a segment, filling per-token columns that do not apply (a single version is broadcast)."""
        toks = np.asarray(tokens, dtype=np.int32)
        n = len(toks)
        lps = np.zeros(n, np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
        if isinstance(versions, int | np.integer):
            vers = np.full(n, int(versions), np.int32)
        else:
            vers = np.full(n, NO_VERSION, np.int32) if versions is None else np.asarray(versions, np.int32)
        return cls(kind, parent, fork_at, toks, lps, vers, engine, t_start, t_end, finish_reason,
                   temperature, top_p)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> bool:
        return self.kind is SegmentKind.GENERATED

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        return (self.kind, self.parent, self.fork_at, self.engine, self.t_start, self.t_end, self.finish_reason,
                self.temperature, self.top_p) \
            == (other.kind, other.parent, other.fork_at, other.engine, other.t_start, other.t_end,
                other.finish_reason, other.temperature, other.top_p) \
            and np.array_equal(self.tokens, other.tokens) and np.array_equal(self.versions, other.versions) \
            and self.logprobs.tobytes() == other.logprobs.tobytes()

    __hash__ = None  # type: ignore[assignment]  # equal by value, but holds arrays

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # Rebuild through __init__ so an unpickled segment (one sent over MPI) is read-only too.
        return (Segment, tuple(getattr(self, f.name) for f in dataclasses.fields(self)))


def check_tree(segments: Sequence[Segment]) -> None:
    """Raise ValueError unless `segments` form a tree rooted at index 0, each parent before its child."""
    for i, seg in enumerate(segments):
        if i == 0:
            if seg.parent != -1 or seg.fork_at != 0:
                raise ValueError("segment 0 must be the root (parent -1, fork_at 0)")
            continue
        if not 0 <= seg.parent < i:
            raise ValueError(f"segment {i} has parent {seg.parent}; a parent must come before its child")
        if not 0 <= seg.fork_at <= len(segments[seg.parent]):
            raise ValueError(f"segment {i} forks at {seg.fork_at} of a parent with {len(segments[seg.parent])} tokens")


AGENT_KEY, EPISODE_KEY = "agent", "episode"  # metadata of the trajectories of a several-agent episode


def agent_of(metadata_json: str) -> str | None:
    """The ``agent`` of a trajectory's metadata (see `Trajectory.agent`); cheap for the common case of none."""
    if AGENT_KEY not in metadata_json:
        return None
    agent = json.loads(metadata_json).get(AGENT_KEY)
    return agent if isinstance(agent, str) and agent else None


def episode_of(trajectory_id: str, metadata_json: str) -> str:
    """The episode a trajectory belongs to: the ``episode`` of its metadata (several agents share one), else
    the trajectory itself (an episode of one agent is one trajectory)."""
    if EPISODE_KEY not in metadata_json:
        return trajectory_id
    episode = json.loads(metadata_json).get(EPISODE_KEY)
    return episode if isinstance(episode, str) and episode else trajectory_id


def branch_of(segments: Sequence[Segment], head: int | None = None) -> list[tuple[int, int]]:
    """The path root -> `head` (default: the last segment) as (segment index, tokens used) pairs."""
    if not segments:
        return []
    index = len(segments) - 1 if head is None else head
    used = len(segments[index])
    path: list[tuple[int, int]] = []
    while index >= 0:
        path.append((index, used))
        seg = segments[index]
        index, used = seg.parent, seg.fork_at
    path.reverse()
    return path


def _along(segments: Sequence[Segment], column: str, dtype: type, head: int | None = None) -> np.ndarray:
    parts = [getattr(segments[i], column)[:used] for i, used in branch_of(segments, head)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One task's interaction, as a value. The manager builds these; the store reads and writes them."""

    id: str
    segments: tuple[Segment, ...]
    task: str = ""
    group: str | None = None  # GRPO group; None: a group of its own
    status: Status = Status.RUNNING
    reward: float | None = None
    turn_rewards: tuple[float, ...] = ()
    metadata_json: str = "{}"  # free-form metadata, kept as JSON text so the record stays immutable
    created: float = 0.0
    updated: float = 0.0  # when the status last changed
    fail_reason: str = ""  # why it failed (status FAILED): "ValueError: ...", "timed out after 600 s"

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "turn_rewards", tuple(float(r) for r in self.turn_rewards))
        if self.reward is not None and math.isnan(self.reward):
            object.__setattr__(self, "reward", None)
        check_tree(self.segments)

    @staticmethod
    def encode_metadata(metadata: dict[str, Any] | None) -> str:
        """JSON text for `metadata`; raises ValueError when it is not JSON-able (caught early, not at write)."""
        try:
            return json.dumps(metadata or {}, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata must be JSON-able: {exc}") from None

    @property
    def metadata(self) -> dict[str, Any]:
        """A fresh copy of the metadata (the record itself cannot be changed)."""
        return json.loads(self.metadata_json)

    @property
    def group_key(self) -> str:
        """The key GRPO groups by: the group id, or the trajectory's own id when it has none."""
        return self.group if self.group is not None else self.id

    @property
    def agent(self) -> str | None:
        """The agent whose conversation this is, in an episode of several agents (None: the only one)."""
        return agent_of(self.metadata_json)

    @property
    def advantage_group(self) -> str:
        """The trajectories a GRPO advantage compares this one with: its group's, and in an episode of several
        agents only those of the same agent (a checker's reward says nothing of a solver's)."""
        agent = self.agent
        return self.group_key if agent is None else f"{self.group_key}/{agent}"

    def branch(self) -> list[tuple[int, int]]:
        """The current branch as (segment index, tokens used) pairs, root first."""
        return branch_of(self.segments)

    def context(self) -> np.ndarray:
        """All tokens along the current branch (int32): the full context of the next token."""
        return _along(self.segments, "tokens", np.int32)

    def generated_mask(self) -> np.ndarray:
        """Per token of `context()`: True where the policy generated it (the tokens a trainer scores)."""
        parts = [np.full(used, self.segments[i].generated) for i, used in self.branch()]
        return np.concatenate(parts) if parts else np.zeros(0, bool)

    def segment_turns(self) -> list[int]:
        """Per segment, the turn (the agent's call, from 0) it belongs to, on every branch: the prompt opens
        turn 0, every other prompt or observation segment the turn after its parent's (each call records one;
        a fork's is the call that forked), and a generated segment belongs to its parent's turn. The turn
        boundaries are the manager's records, not runs of generated tokens: a fork that re-rendered a whole
        earlier reply (a template that drops reasoning) leaves that reply no token on the new branch, and the
        replies after it keep their numbers."""
        turns: list[int] = []
        for segment in self.segments:
            if segment.parent < 0:
                turns.append(0)
            elif segment.generated:
                turns.append(turns[segment.parent])
            else:
                turns.append(turns[segment.parent] + 1)
        return turns

    def token_turns(self) -> np.ndarray:
        """Per token of `context()`: the turn of a generated token (`segment_turns`), -1 for other tokens.
        What a trainer numbers replies by (turn rewards, per-turn baselines)."""
        turns = self.segment_turns()
        parts = [np.full(used, turns[i] if self.segments[i].generated else -1, np.int64) for i, used in self.branch()]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def token_versions(self) -> np.ndarray:
        """Per token of `context()`: the policy version that generated it, -1 for other tokens."""
        return _along(self.segments, "versions", np.int32)

    def token_logprobs(self) -> np.ndarray:
        """Per token of `context()`: the sampling logprob, 0.0 for tokens the policy did not generate."""
        return _along(self.segments, "logprobs", np.float32)

    @property
    def num_tokens(self) -> int:
        return sum(used for _, used in self.branch())

    @property
    def num_generated(self) -> int:
        return sum(used for i, used in self.branch() if self.segments[i].generated)

    @property
    def history_mismatches(self) -> int:
        """How many turns' prompts did not extend what was recorded: the history an agent sent back rendered
        to other tokens than the policy had read and written (a reply re-tokenized, tool-call arguments
        written back in other JSON, reasoning a template drops, an agent that edited earlier turns). Each
        such turn forks a branch where they differ and both are kept; the generated tokens it replaced stay
        on the old branch, so they are never trained on under another spelling."""
        return sum(1 for i, seg in enumerate(self.segments[1:], start=1)
                   if seg.parent != i - 1 or seg.fork_at != len(self.segments[i - 1]))

    def oldest_version(self) -> int | None:
        """The oldest policy version among the branch's generated tokens (None: nothing generated)."""
        versions = self.token_versions()
        versions = versions[versions != NO_VERSION]
        return int(versions.min()) if len(versions) else None

    def reply_spans(self) -> list[list[tuple[int, int]]]:
        """The policy's replies, one per turn that generated (`segment_turns`), in turn order, each as its
        (segment index, tokens used) pairs: the runs of the turn's latest generation, up from its last
        segment through the generated segments it continued (a weight update, a move or a restart split a
        reply into runs). That is the reply as its agent received it, on whichever branch it lies: a later
        turn's fork may have kept only part of it on the current branch."""
        turns = self.segment_turns()
        last: dict[int, int] = {}
        for index, segment in enumerate(self.segments):
            if segment.generated:
                last[turns[index]] = index
        spans = []
        for turn in sorted(last):
            index = last[turn]
            span = [(index, len(self.segments[index]))]
            while (parent := self.segments[index].parent) >= 0 and self.segments[parent].generated:
                span.append((parent, self.segments[index].fork_at))
                index = parent
            spans.append(span[::-1])
        return spans

    def replies(self) -> list[tuple[np.ndarray, bool]]:
        """The policy's replies, one per turn that generated (see `reply_spans`): (its tokens, whether it was
        cut short: its last engine run ended with ``abort``)."""
        out = []
        for span in self.reply_spans():
            last, used = span[-1]
            cut = self.segments[last].finish_reason == "abort" or used < len(self.segments[last])
            out.append((np.concatenate([self.segments[i].tokens[:n] for i, n in span]), cut))
        return out

    def staleness(self, policy_version: int) -> int:
        """How many versions the oldest generated token lags `policy_version` (0 if nothing generated)."""
        oldest = self.oldest_version()
        return 0 if oldest is None else max(0, policy_version - oldest)
