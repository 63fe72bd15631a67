"""Where the endpoint records trajectories: the part of the trajectory manager's API it uses.

`sfhpc.data.manager.TrajectoryManager` satisfies this protocol; so does any object with these methods.
Errors the sink raises for a trajectory id it does not know, or one that is already finished, are
the `sfhpc.data.errors` classes (``UnknownTrajectory``, ``TrajectoryConflict`` and its subclass
``TrajectoryFinished``); the endpoint answers them with 404 and 409. A later turn of a trajectory is one
`observe` call, which must refuse an unknown or closed trajectory with those errors. `add_generated`
carries the sampling the tokens were drawn with (temperature, top-p), which the sink keeps on the segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrajectorySink(Protocol):
    def start(self, prompt_tokens: Sequence[int], *, task: str = "", group: str | None = None,
              metadata: dict[str, Any] | None = None, trajectory_id: str | None = None) -> str: ...

    def observe(self, trajectory_id: str, prompt_tokens: Sequence[int]) -> None: ...

    def add_generated(self, trajectory_id: str, tokens: Sequence[int], logprobs: Sequence[float],
                      versions: int | Sequence[int], *, engine: str = "", finish_reason: str | None = None,
                      temperature: float | None = None, top_p: float | None = None) -> None: ...

    def interrupt(self, trajectory_id: str) -> None: ...

    def finish(self, trajectory_id: str, reward: float | None = None, *, turn_rewards: Any = None) -> None: ...
