"""An agent program's generation moves to another rank's engine while its call stays where it is
(`sfhpc.engine.remote`): two endpoints, each with its own engine, and the real door between them (a TCP
listener with its key in a register folder, a thread per connection). The moved generation continues from its
prefix: with one sampling seed its reply is token for token the reply an uninterrupted generation gives, its
segments name the engine that produced them, and it follows the other engine's pauses and its going away."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint
from sfhpc.endpoint.errors import ShuttingDown
from sfhpc.endpoint.service import Sampling, TurnRequest
from sfhpc.engine.remote import GenerationDoor, RemoteEngines
from sfhpc.engine.scripted import ScriptedEngine

PROMPT = (1, 2, 3)
TOKENS = 120


def _engine(name: str) -> ScriptedEngine:
    # Same weights everywhere (a synced run); no stop token in reach, so every reply runs to its budget.
    return ScriptedEngine(seed=7, token_delay=0.004, name=name, vocab=tuple(range(ord("a"), ord("z") + 1)),
                          max_model_len=1024)


def _request(seed: int, trajectory_id: str | None = None, prompt: tuple[int, ...] = PROMPT) -> TurnRequest:
    return TurnRequest(prompt, Sampling(max_tokens=TOKENS, seed=seed, temperature=1.0), trajectory_id=trajectory_id,
                       group="g")


async def _generating(manager: TrajectoryManager, endpoint: AgentEndpoint, tokens: int) -> None:
    """Until the endpoint's turn has generated at least `tokens` tokens on some engine (recorded or streaming)."""
    while not any(tid for tid in endpoint._running):  # noqa: SLF001 (the test watches the turn start)
        await asyncio.sleep(0.002)
    await asyncio.sleep(tokens * 0.004)


def test_a_routed_generation_continues_from_its_prefix_on_the_other_rank(tmp_path: Path) -> None:
    async def scenario() -> None:
        manager = TrajectoryManager()
        here = AgentEndpoint(_engine("engine-here"), manager)
        there = AgentEndpoint(_engine("engine-there"), manager)
        door = GenerationDoor(tmp_path, 2, asyncio.get_running_loop(), there.running_engine, lambda: "engine-there")
        went: list[int] = []  # the rollout worker's hook: its episodes routed there count at home from then on
        engines = RemoteEngines(tmp_path, max_model_len=here.engine.max_model_len, on_gone=went.append)
        remote = engines.of(2)
        assert engines.of(2) is remote
        reference = await AgentEndpoint(_engine("reference"), TrajectoryManager()).complete(_request(seed=11))
        try:
            # 1. Cut mid-reply and continued there: the same reply, two segments, two engines.
            turn = asyncio.ensure_future(here.complete(_request(seed=11)))
            await _generating(manager, here, 30)
            (tid,) = manager.ids()
            assert here.route([tid], remote) == 1
            result = await turn
            assert result.token_ids == reference.token_ids and result.finish_reason == "length"
            segments = [s for s in manager.trajectory(tid).segments if s.generated]
            assert [s.engine for s in segments] == ["engine-here", "engine-there"]
            assert segments[0].finish_reason == "abort" and 0 < len(segments[0].tokens) < TOKENS
            assert here.generating == 0 and door.served == 1

            # 2. The next turn goes there at once, and follows the other engine's pause (a weight update there).
            context = tuple(int(t) for t in manager.trajectory(tid).context())
            uncut = await AgentEndpoint(_engine("reference"), TrajectoryManager()).complete(
                _request(seed=12, prompt=context))
            turn = asyncio.ensure_future(here.complete(_request(seed=12, trajectory_id=tid, prompt=context)))
            await asyncio.sleep(0.15)
            await there.engine.pause()
            await asyncio.sleep(0.05)
            await there.engine.resume()
            result = await turn
            assert result.token_ids == uncut.token_ids and result.interruptions == 1
            later = [s for s in manager.trajectory(tid).segments if s.generated][2:]
            assert [s.engine for s in later] == ["engine-there", "engine-there"]
            assert later[0].finish_reason == "abort"

            # 3. The other rank takes no more turns (taken back from rollout): the generation comes home.
            context = tuple(int(t) for t in manager.trajectory(tid).context())
            uncut = await AgentEndpoint(_engine("reference"), TrajectoryManager()).complete(
                _request(seed=13, prompt=context))
            turn = asyncio.ensure_future(here.complete(_request(seed=13, trajectory_id=tid, prompt=context)))
            await asyncio.sleep(0.15)
            await there.quiesce()
            there.refuse_turns(True)
            result = await turn
            assert result.token_ids == uncut.token_ids
            last = [s for s in manager.trajectory(tid).segments if s.generated][4:]
            assert [s.engine for s in last] == ["engine-there", "engine-here"]
            assert remote.gone is not None and here.engine_for(tid) is here.engine
            assert went == [2]  # told once


            # 4. Lent again, the rank takes generations again, through a new remote engine (the gone one stays
            # gone). A stop cuts a routed generation too (`quiesce`): what it made is recorded, the turn gives up.
            there.refuse_turns(False)
            await there.engine.resume()
            other = AgentEndpoint(_engine("engine-here-2"), manager)
            turn = asyncio.ensure_future(other.complete(_request(seed=14)))
            await _generating(manager, other, 5)
            (tid2,) = set(manager.ids()) - {tid}
            again = engines.of(2)
            assert again is not remote and again.gone is None
            other.route([tid2], again)
            await asyncio.sleep(0.1)
            await other.quiesce()
            other.close()
            with pytest.raises(ShuttingDown):
                await turn
            assert manager.status(tid2) == "interrupted"
            assert [s.engine for s in manager.trajectory(tid2).segments if s.generated][-1] == "engine-there"
        finally:
            door.close()
            engines.shutdown()

    asyncio.run(scenario())
