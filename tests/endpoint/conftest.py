"""Fixtures: a scripted engine, the trajectory manager, a live endpoint on a free loopback port, clients."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from sfhpc.data.manager import TrajectoryManager
from sfhpc.data.trajectory import Segment
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine.base import GenerationRequest
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.model.hf_folder import build_hf_model

MODEL = "tiny-test"
SERVED_MODEL = "served-policy"  # the name `Served` serves
# Letters and space only: no stop token, so a request runs to max_tokens (long enough to pause mid-way).
LETTERS = (*range(ord("a"), ord("z") + 1), ord(" "))


def make_engine(seed: int = 1, *, delay: float = 0.0, version: int = 0, name: str = "scripted",
                vocab: Sequence[int] | None = None, max_model_len: int = 256) -> ScriptedEngine:
    kwargs = {} if vocab is None else {"vocab": tuple(vocab)}
    return ScriptedEngine(seed=seed, token_delay=delay, version=version, name=name, max_model_len=max_model_len,
                          **kwargs)


def replay(engine: ScriptedEngine, prompt: Sequence[int], max_new: int, *, temperature: float = 1.0,
           seed: int | None = None, stop: Sequence[int] = ()) -> tuple[list[int], list[float]]:
    """What `engine` generates for `prompt`, uninterrupted, run on a private loop (in its own thread, so a
    test may call it from inside a running loop)."""
    async def run() -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        logprobs: list[float] = []
        request = GenerationRequest("replay", tuple(prompt), max_new, temperature=temperature, seed=seed,
                                    stop_token_ids=tuple(stop))
        async for chunk in engine.generate(request):
            tokens += chunk.token_ids
            logprobs += chunk.logprobs
        return tokens, logprobs
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


class ReplyingEngine(ScriptedEngine):
    """Writes the given replies, one per generation, token by token (with a fixed logprob): a test engine
    for what a model does with a known reply (a tool call in its format, a final answer)."""

    def __init__(self, replies: Sequence[Sequence[int]]) -> None:
        super().__init__(vocab=(0, 1), max_model_len=2048)
        self.replies = [list(r) for r in replies]
        self._script: dict[str, list[int]] = {}

    def _sample(self, context: Sequence[int], request: GenerationRequest) -> tuple[int, float]:
        if request.request_id not in self._script:
            self._script[request.request_id] = self.replies.pop(0)
        reply = self._script[request.request_id]
        at = len(context) - len(request.prompt_token_ids)
        return reply[at], -0.25


class RecordingManager(TrajectoryManager):
    """The real (in-memory) trajectory manager that also notes, per trajectory, the order of the calls the
    endpoint made, so tests can assert on the protocol as well as on the records."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, list[str]] = defaultdict(list)

    def start(self, prompt_tokens: Sequence[int], **kwargs: Any) -> str:
        tid = super().start(prompt_tokens, **kwargs)
        self.calls[tid].append("start")
        return tid

    def observe(self, trajectory_id: str, prompt_tokens: Sequence[int]) -> None:
        super().observe(trajectory_id, prompt_tokens)
        self.calls[trajectory_id].append("observe")

    def add_generated(self, trajectory_id: str, tokens: Sequence[int], logprobs: Sequence[float],
                      versions: int | Sequence[int], **kwargs: Any) -> None:
        super().add_generated(trajectory_id, tokens, logprobs, versions, **kwargs)
        self.calls[trajectory_id].append(f"add_generated:{kwargs.get('finish_reason')}")

    def interrupt(self, trajectory_id: str) -> None:
        super().interrupt(trajectory_id)
        self.calls[trajectory_id].append("interrupt")

    def generated(self, trajectory_id: str) -> list[Segment]:
        return [s for s in self.trajectory(trajectory_id).segments if s.generated]


@pytest.fixture
def sink() -> RecordingManager:
    return RecordingManager()


@pytest.fixture
def engine() -> ScriptedEngine:
    return make_engine(seed=1)


@pytest.fixture
def server(engine: ScriptedEngine, sink: RecordingManager) -> Iterator[EndpointServer]:
    api = OpenAIApi(AgentEndpoint(engine, sink), model_name=MODEL)
    with EndpointServer(api) as running:
        yield running


@pytest.fixture
def client(server: EndpointServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 folder with Qwen2.5's tool-calling chat template."""
    return build_hf_model(tmp_path_factory.mktemp("qwen-tools"), "qwen2", chat_format="qwen2_tools", layers=1)


class Served:
    """A live endpoint over a replying engine, with the tokenizer of a model folder."""

    def __init__(self, folder: Path) -> None:
        self.tok = HFTokenizer.from_folder(folder)
        self.sink = RecordingManager()
        self.engine = ReplyingEngine([])
        self.api = OpenAIApi(AgentEndpoint(self.engine, self.sink), model_name=SERVED_MODEL, tokenizer=self.tok)
        self.server = EndpointServer(self.api).start()
        self.client = openai.OpenAI(base_url=self.server.url, api_key="unused", max_retries=0, timeout=30)

    def will_reply(self, *texts: str) -> None:
        """The next replies, each ending with the template's end-of-turn token."""
        self.engine.replies += [self.tok.encode(t) + [self.tok.chat_stop_ids[0]] for t in texts]

    def context(self, trajectory_id: str) -> list[int]:
        return [int(t) for t in self.sink.trajectory(trajectory_id).context()]


@pytest.fixture
def qwen(qwen_folder: Path) -> Iterator[Served]:
    """`Served` over `qwen_folder`."""
    served = Served(qwen_folder)
    yield served
    served.server.stop()
