"""What sfhpc adds to vLLM's worker processes (vLLM's ``worker_extension_cls``): joining the weight group and
receiving weights there, so that a version goes from the trainer's buffers into the worker's own device
memory (NCCL between GPUs, gloo on CPUs) with no copy through the rollout rank and no pickle.

vLLM mixes this class into its worker class and calls its methods by name through ``collective_rpc``: every
worker of the engine (one per tensor-parallel rank) runs them. Each worker receives the whole version and
`reload_weights` takes from it what its own shard needs. Only the manifest (names, shapes, offsets) travels
with the call. With ``engine.staged_updates`` a version is received into a second copy while the worker goes on
generating, and loaded from there in one pause. An adapter version (LoRA, `sfhpc.weights.adapter`) is received
whole and merged into the frozen weights of the folder the engine started from, on the worker's device, before
it is reloaded. The module is imported inside vLLM's worker: nothing here imports MPI.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from sfhpc.weights import adapter
from sfhpc.weights import group as weight_group
from sfhpc.weights.manifest import WeightManifest, unpack

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM's in-place reload
EXTENSION = f"{__name__}.WeightGroupWorker"  # the engine argument that names this class


class QuietRotaryReload(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning, logged on every in-place reload:
    the rotary embedding holds a computed cos/sin cache that no checkpoint carries, and vLLM puts it back
    as it was. One such line per weight update would bury a run's progress; other layers still warn."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def reload_in_place(model_runner: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Load `weights` (any subset of the model's, in checkpoint naming) into the running model in place."""
    reload_log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, QuietRotaryReload) for f in reload_log.filters):
        reload_log.addFilter(QuietRotaryReload())
    model_runner.reload_weights(weights_iterator=iter(weights))
    if any(name.endswith("embed_tokens.weight") for name, _ in weights):
        refresh_tied_head(model_runner.get_model())


def refresh_tied_head(model: Any) -> bool:
    """Re-process an output head tied to the input embeddings after the embeddings were reloaded; True if
    there was one.

    vLLM on CPUs packs each layer's weight for its GEMM kernels when it processes the layer, and an in-place
    reload re-processes the layers whose weights it loaded. A head tied to the embeddings (Qwen2.5 up to 3B,
    most small models) is a layer of its own that shares the embedding's weight but keeps its own packed
    copy; no weight is loaded into it, so its copy stayed the first version's: the engine went on sampling
    from the old head while every other layer had the new weights, and its logprobs no longer matched the
    trainer's (seen on a tiny Qwen2: 2.1 nats apart after one update). On GPUs the head reads the shared
    weight directly, and processing it again does nothing."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head is embed:
        return False
    weight, tied = getattr(head, "weight", None), getattr(embed, "weight", None)
    if weight is None or tied is None or weight.data_ptr() != tied.data_ptr():
        return False
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


class WeightGroupWorker:
    """Methods vLLM's worker gains (``self`` is the worker: ``rank``, ``device``, ``model_runner``)."""

    rank: int
    model_runner: Any
    model_config: Any
    _sfhpc_weight_group: Any = None
    _sfhpc_adapter_merge: adapter.AdapterMerge | None = None
    _sfhpc_weight_device: torch.device = torch.device("cpu")
    # engine.staged_updates: the second copy a version is received into while the worker generates, and the
    # version on its way there (its manifest, bucket starts in the copy and the group's transfers)
    _sfhpc_staging_copy: torch.Tensor | None = None
    _sfhpc_staged: tuple[WeightManifest, list[int], list[Any]] | None = None

    def sfhpc_join_weight_group(self, address: dict[str, Any], first_member: int) -> int:
        """Join the weight group as member ``first_member + rank``; returns once every member has joined."""
        group = weight_group.WeightGroup.from_json(address)
        member = first_member + self.rank
        self._sfhpc_weight_group = weight_group.join(group, member)
        self._sfhpc_weight_device = group.device  # this worker's GPU under NCCL
        return member

    def sfhpc_stage_weights(self, plain_manifest: dict[str, Any]) -> int:
        """Start receiving every bucket of the manifest into a second copy of the weights in this worker's memory
        (kept from one version to the next) and return at once: the worker goes on generating with the weights
        it holds while the group's transfers run (NCCL on its own stream, gloo in its own threads).
        `sfhpc_staged_arrived` says when they are done, `sfhpc_load_staged` loads the copy. Returns the bytes."""
        manifest = WeightManifest.from_json(plain_manifest)
        group = self._sfhpc_weight_group
        if group is None:
            raise RuntimeError("this vLLM worker never joined a weight group")
        if self._sfhpc_staged is not None:
            raise RuntimeError("a staged version is still waiting to be loaded")
        copy = self._sfhpc_staging_copy
        if copy is None or copy.numel() < manifest.total_bytes:
            self._sfhpc_staging_copy = copy = None
            copy = self._sfhpc_staging_copy = torch.empty(manifest.total_bytes, dtype=torch.uint8,
                                                          device=self._sfhpc_weight_device)
        starts = [0, *itertools.accumulate(manifest.bucket_sizes)]
        works = [weight_group.broadcast(group, copy[starts[index] + m.offset:starts[index] + m.end])
                 for index in range(manifest.num_buckets) for m in manifest.bucket_messages(index)]
        self._sfhpc_staged = (manifest, starts, works)
        return manifest.total_bytes

    def sfhpc_staged_arrived(self) -> bool:
        """True once every bucket of the staged version is in this worker's copy."""
        if self._sfhpc_staged is None:
            raise RuntimeError("no version is staged")
        return all(work.is_completed() for work in self._sfhpc_staged[2])

    def sfhpc_load_staged(self) -> int:
        """Load the staged version from this worker's copy (a device-memory copy on a GPU); returns its buckets."""
        if self._sfhpc_staged is None:
            raise RuntimeError("no version is staged")
        manifest, starts, works = self._sfhpc_staged
        for work in works:
            work.wait()
        self._sfhpc_staged = None
        copy = self._sfhpc_staging_copy
        assert copy is not None
        named = [item for index in range(manifest.num_buckets)
                 for item in unpack(copy[starts[index]:starts[index + 1]], manifest.bucket(index))]
        if adapter.is_adapter(name for name, _ in named):
            self._load_adapter([(name, t.clone()) for name, t in named])
        elif named:
            reload_in_place(self.model_runner, named)
        return manifest.num_buckets

    def _load_adapter(self, received: list[tuple[str, torch.Tensor]]) -> None:
        """An adapter version merged into the frozen weights of the folder this engine started from, reloaded."""
        merge = self._sfhpc_adapter_merge
        if merge is None:  # the frozen weights of the folder this engine started from, kept in host memory
            merge = self._sfhpc_adapter_merge = adapter.AdapterMerge(self.model_config.model,
                                                                     self.model_config.dtype,
                                                                     device=self._sfhpc_weight_device)
        for load_ in merge.loads(adapter.deltas_of(received)):
            reload_in_place(self.model_runner, load_)

    def sfhpc_receive_weights(self, plain_manifest: dict[str, Any], load: bool) -> int:
        """Receive every bucket of the manifest (`WeightManifest.to_json`) into this worker's memory and (with
        `load`) reload it in place; the next bucket is on its way while one loads. Returns the buckets received."""
        manifest = WeightManifest.from_json(plain_manifest)
        group = self._sfhpc_weight_group
        if group is None:
            raise RuntimeError("this vLLM worker never joined a weight group")
        device = self._sfhpc_weight_device
        largest = max(manifest.bucket_sizes, default=0)
        buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(min(2, manifest.num_buckets))]

        def post(index: int) -> list[Any]:
            buffer = buffers[index % len(buffers)]
            return [weight_group.broadcast(group, buffer[m.offset:m.end]) for m in manifest.bucket_messages(index)]

        is_adapter = adapter.is_adapter(t.name for t in manifest.tensors)
        received: list[tuple[str, torch.Tensor]] = []
        pending = post(0) if manifest.num_buckets else []
        for index in range(manifest.num_buckets):
            for work in pending:
                work.wait()
            # The other buffer is free once the bucket before this one is loaded: receive into it meanwhile.
            named = unpack(buffers[index % len(buffers)], manifest.bucket(index)) if load else []
            if is_adapter:
                received += [(name, t.clone()) for name, t in named]
            pending = post(index + 1) if index + 1 < manifest.num_buckets else []
            if named and not is_adapter:
                reload_in_place(self.model_runner, named)
        if received:
            self._load_adapter(received)
        return manifest.num_buckets
