"""Rank program of the engine weight-sync test:
`mpiexec -n 2 python -m tests.weights.vllm_ranks MODEL OUT mpi,torch,mpi-delta,torch-staged,mpi-staged` (each
stream in turn, one engine: `mpi`; `torch`, where vLLM's worker joins a gloo group and receives the buckets
itself; `mpi-delta`, delta updates over MPI: the perturbation then touches a tenth of the elements, and restoring
them is a delta of a tenth of the words, which the rank applies to its copy before the engine loads the changed
buckets; `-staged`, staged updates: the version comes in beside the weights that generate, into the worker's
second copy over gloo or into the rank's copy over MPI, while a generation goes on, and is loaded in one pause).

Rank 0 is a trainer (`TorchTrainer` on the model folder). Over each transport it perturbs its float32 master
weights (the same perturbation every time) and publishes them (cast to bf16 on the way, in small buckets),
scores a reply the engine sampled with them (its own logprobs of those tokens), then publishes the original
weights and finishes that transport's stream. Rank 1 runs a real vLLM engine on the same folder and records
a greedy generation before any update and after each one (tokens and the version each token is tagged
with), the sampled reply with the engine's logprobs, and the buckets and versions it received.

No mpi4py (nor anything that imports it) at module level: vLLM's engine process re-imports this
module, and MPI_Init there fails.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

BUCKET_BYTES = 1 << 20  # the tiny model (6.5 MB) then arrives in several buckets


def polled_barrier(comm: Any) -> None:
    """A barrier that sleeps instead of spinning a core the other rank's engine needs."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.02)


def polled_recv(comm: Any, source: int) -> Any:
    request = comm.irecv(source=source)
    while True:
        done, value = request.test()
        if done:
            return value
        time.sleep(0.02)


def trainer_rank(comm: Any, streams: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    import torch

    from sfhpc.trainer.torch_trainer import TorchTrainer
    from sfhpc.weights import WeightPublisher, connect

    trainer = TorchTrainer(model_dir)
    original = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    record: dict[str, Any] = {}
    for index, (stream, weights) in enumerate(streams.items()):
        transport, delta = stream.split("-")[0], stream.endswith("-delta")
        publisher = WeightPublisher(connect(weights, transport), bucket_bytes=BUCKET_BYTES, delta=delta)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in trainer.model.parameters():
                noise = 0.05 * torch.randn(p.shape, generator=gen)
                if delta:  # a tenth of the elements, moved further
                    noise = 4 * noise * (torch.rand(p.shape, generator=gen) < 0.1)
                p.add_(noise)
        polled_barrier(comm)  # the engine is up (and has its "before" output)
        first = publisher.publish(trainer.named_weights(), version=2 * index + 1, dtype=torch.bfloat16)
        prompt, tokens = polled_recv(comm, source=1)  # a reply the engine sampled with those weights
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
            scored = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            for name, p in trainer.model.named_parameters():
                p.copy_(original[name])
        polled_barrier(comm)  # the engine has generated with the perturbed weights
        second = publisher.publish(trainer.named_weights(), version=2 * index + 2, dtype=torch.bfloat16)
        publisher.finish()
        record[stream] = {"buckets": [first.buckets, second.buckets],
                          "manifest_sent": [first.manifest_sent, second.manifest_sent],
                          "wire_bytes": [first.wire_bytes, second.wire_bytes], "bytes": [first.bytes, second.bytes],
                          "transport": type(publisher.transport).__name__, "scored_logprobs": scored}
    return record


async def engine_rank(comm: Any, streams: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    from sfhpc.engine.base import GenerationRequest
    from sfhpc.engine.tokenizer import load_tokenizer
    from sfhpc.engine.vllm_engine import VllmEngine
    from sfhpc.engine.weight_sync import StagedVersion, apply_version, next_version, receive_beside
    from sfhpc.weights import WeightReceiver, connect

    engine = VllmEngine.start("vllm-0", model_dir, max_model_len=256)
    prompt = tuple(load_tokenizer(model_dir).encode("weights", bos=True))
    loop = asyncio.get_running_loop()

    def join_engine(group: Any, first_member: int) -> None:  # connect runs in a thread; the engine on this loop
        asyncio.run_coroutine_threadsafe(engine.join_weight_group(group, first_member), loop).result()

    calls = 0

    async def generate(temperature: float) -> dict[str, list[Any]]:
        nonlocal calls
        calls += 1
        tokens: list[int] = []
        versions: list[int] = []
        logprobs: list[float] = []
        async for chunk in engine.generate(GenerationRequest(f"request-{calls}", prompt, 16, temperature=temperature,
                                                             seed=3)):
            tokens += chunk.token_ids
            versions += chunk.versions
            logprobs += chunk.logprobs
        return {"tokens": tokens, "versions": versions, "logprobs": logprobs}

    async def sync() -> None:
        request = comm.Ibarrier()
        while not request.Test():
            await asyncio.sleep(0.02)

    record: dict[str, Any] = {"before": await generate(0.0)}
    try:
        for stream_name, weights in streams.items():
            transport, delta, staged = (stream_name.split("-")[0], stream_name.endswith("-delta"),
                                        stream_name.endswith("-staged"))
            # A delta is applied by the rank; a staged version over MPI comes into the rank's copy.
            members = 0 if delta or (staged and transport == "mpi") else engine.weight_group_members
            link = await asyncio.to_thread(connect, weights, transport, engine_members=members,
                                           join_engine=join_engine if members else None)
            receiver = WeightReceiver(link, keep_copy=delta or (staged and not link.engine_receives))
            stream: dict[str, Any] = {"loaded": [], "engine_versions": [], "staged": [],
                                      "lands_in_engine": receiver.transport.engine_receives}
            for name in ("perturbed", "restored"):
                await sync()
                incoming = await next_version(receiver)
                assert incoming is not None
                stream["loaded"].append({"version": incoming.version, "buckets": incoming.num_buckets,
                                         "largest_bucket": max(incoming.manifest.bucket_sizes)})
                loading: Any = incoming
                if staged:  # a generation goes on while the version comes in: the engine is not paused for it
                    pauses, going_on = engine.pauses, asyncio.create_task(generate(1.0))
                    loading = await receive_beside(engine, incoming)
                    beside = engine.staged_version == incoming.version or isinstance(loading, StagedVersion)
                    generated = await going_on
                    stream["staged"].append({"beside": beside, "pauses": engine.pauses - pauses,
                                             "versions": sorted(set(generated["versions"])),
                                             "tokens": len(generated["tokens"])})
                stream["engine_versions"].append(await apply_version(engine, loading))
                stream[name] = await generate(0.0)
                stream[name]["engine_version"] = engine.version
                if name == "perturbed":  # the trainer scores a reply sampled with its weights
                    stream["sampled"] = await generate(1.0)
                    await asyncio.to_thread(comm.send, (list(prompt), stream["sampled"]["tokens"]), 0)
            stream["finished"] = await next_version(receiver) is None
            record[stream_name] = stream
    finally:
        engine.shutdown()
    return record


def main() -> int:
    from mpi4py import MPI

    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    world = MPI.COMM_WORLD
    comm = world.Split(0, world.Get_rank())  # the test's own synchronisation
    # One weight-broadcast group per transport (trainer root, engine rank), each carrying nothing else.
    streams = {transport: comm.Dup() for transport in sys.argv[3].split(",")}
    record = (trainer_rank(comm, streams, model_dir) if comm.Get_rank() == 0
              else asyncio.run(engine_rank(comm, streams, model_dir)))
    (out / f"rank{comm.Get_rank()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
