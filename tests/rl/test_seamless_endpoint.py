"""A rank taken back from rollout (``seamless`` reclaim): after the engine is paused, turns waiting for it give
up instead of waiting (their tokens so far recorded, the trajectory interrupted), new turns are refused
until the rank is lent again, and the interrupted trajectory continues elsewhere from its prefix."""

from __future__ import annotations

import asyncio

import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint
from sfhpc.endpoint.errors import ShuttingDown
from sfhpc.endpoint.service import Sampling, TurnRequest
from sfhpc.engine.scripted import ScriptedEngine

PROMPT = (1, 2, 3)


def test_refused_turns_give_up_with_their_prefix_and_continue_on_another_engine() -> None:
    async def scenario() -> None:
        manager = TrajectoryManager()
        lent = AgentEndpoint(ScriptedEngine(seed=1, token_delay=0.01, name="lent"), manager)
        turn = asyncio.ensure_future(lent.complete(TurnRequest(PROMPT, Sampling(max_tokens=200), group="g")))
        while not manager.ids():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # some tokens generated
        assert await lent.quiesce() == 1  # the generation is cut and recorded
        lent.refuse_turns(True)
        with pytest.raises(ShuttingDown, match="taken back from rollout"):
            await turn
        (tid,) = manager.ids()
        assert manager.status(tid) == "interrupted"
        prefix = manager.trajectory(tid).replies()[-1][0]
        assert 0 < len(prefix) < 200
        await lent.engine.resume()
        with pytest.raises(ShuttingDown):  # refused until lent again
            await lent.complete(TurnRequest(PROMPT, Sampling(max_tokens=5)))
        lent.refuse_turns(False)
        assert len((await lent.complete(TurnRequest(PROMPT, Sampling(max_tokens=5)))).token_ids) == 5

        other = AgentEndpoint(ScriptedEngine(seed=2, name="other"), manager)
        trajectory = manager.trajectory(tid)
        rest = await other.complete(TurnRequest(tuple(int(t) for t in trajectory.context()),
                                                Sampling(max_tokens=200 - len(prefix)), trajectory_id=tid))
        reply, cut = manager.trajectory(tid).replies()[-1]
        assert not cut and list(reply) == [*prefix, *rest.token_ids]
        engines = [s.engine for s in manager.trajectory(tid).segments if s.generated]
        assert engines == ["lent", "other"]

    asyncio.run(scenario())
