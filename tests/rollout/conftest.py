"""Fixtures of the agent program tests: a live endpoint on the deterministic test engine, and the manager
that records what it serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi, new_run_token
from sfhpc.engine.scripted import ScriptedEngine

MODEL = "tiny-test"


@pytest.fixture
def manager() -> TrajectoryManager:
    return TrajectoryManager()


@pytest.fixture
def server(manager: TrajectoryManager) -> Iterator[EndpointServer]:
    # Digits only, so that the model's replies are guesses; the test engine is seeded and deterministic.
    engine = ScriptedEngine(seed=3, vocab=tuple(range(ord("0"), ord("9") + 1)), max_model_len=256)
    api = OpenAIApi(AgentEndpoint(engine, manager), model_name=MODEL, token=new_run_token())
    with EndpointServer(api) as running:
        yield running
