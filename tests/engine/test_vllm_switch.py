"""vLLM's insecure-serialization switch is on only while an engine starts, not for the rank's lifetime.

No vLLM is started: stand-ins for the three vLLM modules `VllmEngine.start` uses record what the
environment held when the engine's processes would have been spawned and when this process's vLLM
settings were frozen.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

from sfhpc.engine.vllm_engine import INSECURE_SERIALIZATION, VllmEngine, insecure_serialization_while_starting


class FakeVllm:
    """Stand-in modules ``vllm``, ``vllm.envs``, ``vllm.engine.arg_utils``, ``vllm.v1.engine.async_llm``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, can_freeze: bool = True, fail: bool = False) -> None:
        self.seen: dict[str, str | None] = {}
        fake = self

        class AsyncEngineArgs:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs = kwargs

        class AsyncLLM:
            @classmethod
            def from_engine_args(cls, args: AsyncEngineArgs) -> AsyncLLM:
                fake.seen["spawn"] = os.environ.get(INSECURE_SERIALIZATION)  # what the engine processes inherit
                if fail:
                    raise RuntimeError("engine failed to start")
                return cls()

        envs = types.ModuleType("vllm.envs")
        if can_freeze:
            envs.enable_envs_cache = lambda: fake.seen.__setitem__(  # type: ignore[attr-defined]
                "frozen", os.environ.get(INSECURE_SERIALIZATION))
        modules = {"vllm": types.ModuleType("vllm"), "vllm.envs": envs,
                   "vllm.engine": types.ModuleType("vllm.engine"),
                   "vllm.engine.arg_utils": types.ModuleType("vllm.engine.arg_utils"),
                   "vllm.v1": types.ModuleType("vllm.v1"), "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
                   "vllm.v1.engine.async_llm": types.ModuleType("vllm.v1.engine.async_llm")}
        modules["vllm"].envs = envs  # type: ignore[attr-defined]
        modules["vllm.engine.arg_utils"].AsyncEngineArgs = AsyncEngineArgs  # type: ignore[attr-defined]
        modules["vllm.v1.engine.async_llm"].AsyncLLM = AsyncLLM  # type: ignore[attr-defined]
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)


def test_the_switch_is_set_for_the_engine_start_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    fake = FakeVllm(monkeypatch)
    engine = VllmEngine.start("vllm-0", "/nowhere", max_model_len=64)
    assert fake.seen == {"spawn": "1", "frozen": "1"}  # the engine's processes and this one's vLLM have it
    assert INSECURE_SERIALIZATION not in os.environ  # nothing this rank starts later inherits it
    assert engine.max_model_len == 64


def test_a_value_set_by_the_user_comes_back_and_a_failed_start_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INSECURE_SERIALIZATION, "0")
    FakeVllm(monkeypatch)
    VllmEngine.start("vllm-0", "/nowhere")
    assert os.environ[INSECURE_SERIALIZATION] == "0"
    monkeypatch.delenv(INSECURE_SERIALIZATION)
    fake = FakeVllm(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="failed to start"):
        VllmEngine.start("vllm-0", "/nowhere")
    assert fake.seen == {"spawn": "1"} and INSECURE_SERIALIZATION not in os.environ


def test_a_vllm_that_cannot_freeze_its_settings_keeps_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its own side would otherwise refuse to ship the weight loader later: the old, process-wide behaviour.
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    FakeVllm(monkeypatch, can_freeze=False)
    with insecure_serialization_while_starting():
        pass
    assert os.environ[INSECURE_SERIALIZATION] == "1"
