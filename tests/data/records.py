"""Deterministic trajectories for the data-plane tests (also used by the subprocesses they start)."""

from __future__ import annotations

import hashlib

import numpy as np

from sfhpc.data.trajectory import Segment, SegmentKind, Status, Trajectory


def make_trajectory(i: int, *, status: Status = Status.FINISHED) -> Trajectory:
    """Trajectory number `i`: a prompt, two generated turns with an observation between, and a fork."""
    rng = np.random.default_rng(i)
    t0 = 1000.0 + i

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, 50_000, n, dtype=np.int32)

    def generated(parent: int, fork_at: int, n: int, version: int, reason: str) -> Segment:
        return Segment(SegmentKind.GENERATED, parent, fork_at, tokens(n),
                       (-rng.random(n) * 5).astype(np.float32), np.full(n, version, np.int32),
                       engine=f"rollout-{i % 3}", t_start=t0 + 1, t_end=t0 + 2, finish_reason=reason)

    prompt = Segment(SegmentKind.PROMPT, -1, 0, tokens(int(rng.integers(50, 150))), t_start=t0, t_end=t0)
    first = generated(0, len(prompt), int(rng.integers(100, 300)), i // 10, "stop")
    observation = Segment(SegmentKind.OBSERVATION, 1, len(first), tokens(40), t_start=t0 + 2, t_end=t0 + 2)
    second = generated(2, 40, int(rng.integers(100, 300)), i // 10 + 1, "length")
    fork = Segment(SegmentKind.OBSERVATION, 1, len(first) // 2, tokens(5), t_start=t0 + 3, t_end=t0 + 3)
    final = generated(4, 5, int(rng.integers(20, 200)), i // 10 + 1, "stop")
    return Trajectory(id=f"traj-{i:06d}", segments=(prompt, first, observation, second, fork, final),
                      task="arith", group=f"group-{i // 4}" if i % 5 else None, status=status,
                      reward=None if i % 7 == 0 else float(i % 2), turn_rewards=(0.25, float(i)),
                      metadata_json=Trajectory.encode_metadata({"i": i, "note": "ünïcode"}),
                      created=t0, updated=t0 + 4)


def fingerprint(t: Trajectory) -> str:
    """A digest of every byte of the record, to check that a read gives back exactly what was written."""
    digest = hashlib.sha256()
    digest.update(repr((t.id, t.task, t.group, str(t.status), t.reward, t.turn_rewards, t.metadata_json,
                        t.created, t.updated)).encode())
    for s in t.segments:
        digest.update(repr((str(s.kind), s.parent, s.fork_at, s.engine, s.t_start, s.t_end,
                            s.finish_reason)).encode())
        digest.update(s.tokens.tobytes() + s.logprobs.tobytes() + s.versions.tobytes())
    return digest.hexdigest()
