"""Step costs of an RL pipeline on GPUs: the one place where modelled compute times live.

Whatever models compute instead of running it (the cluster-scale simulation, timing-model engines and
trainers) asks a `CostModel` how long a step takes:

* ``decode_step_s(gpu, batch)``: one decode step of an engine holding `batch` concurrent sequences (each
  of them gets one token). Decoding is memory-bound: a step reads the weights once and the KV cache of
  every sequence, so the step time is ``base + batch * per_sequence`` and throughput grows with the batch
  until the engine's KV room (``max_batch``) is full.
* ``prefill_s(gpu, tokens)``: the prompt (or a turn's new observation) entering the KV cache; compute-bound.
* ``train_s(gpu, tokens, gpus)``: one optimisation step over `tokens` trained tokens on `gpus` GPUs of one
  type (forward + backward, data parallel).
* ``weight_sync_s()``: broadcasting the new weights (bf16) to the engines.
* ``lend_s(gpu)`` / ``reclaim_s(gpu)``: a trainer GPU handed to rollout (trainer state offloaded to host
  memory, the engine's weights woken) and taken back (engine put to sleep, trainer state reloaded).

Two ways to build one: `CostModel.published(model)` from vendor figures and published measurements (cited
where they are used below; what is assumed says "assumed"), and `CostModel.calibrated_from(rows, ...)`
from a real run's ``metrics.jsonl``, so a timing model of this machine runs at this machine's speed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from sfhpc.data.run_log import is_training_row
from sfhpc.errors import SfhpcError


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Vendor peak figures of one GPU type."""

    name: str
    bf16_tflops: float         # dense (no 2:4 sparsity) BF16 tensor-core peak
    memory_gb_s: float         # device memory bandwidth
    memory_gib: float
    host_gb_s: float           # host <-> device, one direction (PCIe)


# NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16 (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s,
# PCIe Gen5 x16 128 GB/s (both directions together, so 64 GB/s each way).
# NVIDIA L40S datasheet: 362 TFLOPS BF16 (733 with sparsity), 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16
# 64 GB/s (both directions together, 32 GB/s each way).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", bf16_tflops=989.0, memory_gb_s=3350.0, memory_gib=80.0, host_gb_s=64.0),
    "l40s": GpuSpec("l40s", bf16_tflops=362.0, memory_gb_s=864.0, memory_gib=48.0, host_gb_s=32.0),
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the costs need of a model: its size and the shape of its KV cache."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0  # K and V, bf16


# From the models' config.json on the Hugging Face hub (num_hidden_layers, num_key_value_heads,
# hidden_size / num_attention_heads) and their model cards (parameter counts).
MODELS: dict[str, ModelSpec] = {
    "qwen2.5-1.5b": ModelSpec("qwen2.5-1.5b", params=1.54e9, layers=28, kv_heads=2, head_dim=128),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", params=7.61e9, layers=28, kv_heads=4, head_dim=128),
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", params=32.5e9, layers=64, kv_heads=8, head_dim=128),
}

# Efficiencies (fractions of the vendor peak that real software reaches).
# Decode at batch 1 reads the weights at about 77% of the memory-bandwidth roofline (vLLM, Llama-3.1-8B on
# an A100 40GB, about 75 tokens/s; J. Musgrave, "vLLM throughput-latency sweep on NVIDIA A100",
# johnmusgrave.com/p/vllm-throughput-latency-sweep-on).
DECODE_BANDWIDTH_EFFICIENCY = 0.77
# Megatron-LM's README: "up to 47% Model FLOP Utilization (MFU) on H100 clusters" (2B-462B models, 4,096
# token sequences); RL trainers of 1.5-32B models on variable-length batches do less: 35% is assumed.
TRAIN_MFU = 0.35
# Prefill runs large GEMMs like training's forward pass; 50% of peak is assumed.
PREFILL_MFU = 0.50
# Decode's GEMMs are thin (batch x hidden): the compute part of a decode step at 30% of peak is assumed.
DECODE_COMPUTE_MFU = 0.30
# A training token costs 6 N FLOPs forward + backward (Kaplan et al. 2020, "Scaling Laws for Neural
# Language Models", C ~ 6 N per token), plus one forward of 2 N for the old policy's log-probabilities
# that PPO/GRPO's ratio needs (assumed: recomputed on the trainer).
TRAIN_FLOPS_PER_PARAM_TOKEN = 6.0 + 2.0
# An engine batches at most 256 sequences (vLLM's max_num_seqs default in many releases; newer ones pick it
# per hardware, so assumed).
VLLM_MAX_NUM_SEQS = 256
# vLLM's default gpu_memory_utilization: 90% of the GPU's memory for weights + KV cache.
VLLM_MEMORY_UTILIZATION = 0.90
# Weights reach the rollout nodes over their NIC: 100 Gb/s Ethernet (12.5 GB/s) on the L40S pool of
# recipes/cluster-h100-l40s.yaml; a pipelined broadcast streams at about the link rate whatever the
# number of receivers; 80% of the link rate is assumed, plus 20 us of latency per tree level (assumed).
SYNC_LINK_GB_S = 12.5
SYNC_LINK_EFFICIENCY = 0.80
SYNC_HOP_LATENCY_S = 20e-6
# vLLM sleep mode (blog.vllm.ai/2025/10/26/sleep-mode.html, "Zero-Reload Model Switching with vLLM Sleep
# Mode"): a level-1
# wake (weights back from host memory) takes 0.1-6 s from small models to 235B; here: weights / one
# direction of PCIe plus 0.1 s of fixed cost (the blog's smallest wake). Sleep at level 2 (the weights are
# replaced by the next sync anyway) frees memory without copying: the fixed cost only.
ENGINE_FIXED_S = 0.1
# A lent trainer GPU first moves its shard of the trainer state (bf16 weights, fp32 master weights and two
# Adam moments: 2 + 4 + 8 = 14 bytes per parameter, sharded over the data-parallel trainer GPUs, as
# FSDP/ZeRO-3 do) to host memory, and takes it back when reclaimed.
TRAINER_STATE_BYTES_PER_PARAM = 14.0


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
    """Step costs on one GPU type (seconds)."""

    decode_base_s: float          # one decode step, whatever the batch (reading the weights)
    decode_per_sequence_s: float  # added per sequence in the batch (its KV cache, its share of the GEMMs)
    prefill_per_token_s: float
    train_per_token_s: float      # one GPU, forward + backward + old log-probs
    max_batch: int                # sequences an engine holds at once (KV room, max_num_seqs)
    host_gb_s: float = 32.0

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + max(batch, 1) * self.decode_per_sequence_s

    def tokens_per_s(self, batch: int) -> float:
        """Generated tokens/s of one engine decoding `batch` sequences."""
        return batch / self.decode_step_s(batch)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Step costs per GPU type, weight sync and lending: see the module docstring."""

    devices: Mapping[str, DeviceCosts]
    weight_bytes: float
    sync_gb_s: float = SYNC_LINK_GB_S * SYNC_LINK_EFFICIENCY
    engine_fixed_s: float = ENGINE_FIXED_S
    trainer_state_bytes: float = 0.0   # the whole trainer state; each trainer GPU holds its share
    source: str = "published"          # "published" (vendor figures) or what it was calibrated from

    def device(self, gpu: str) -> DeviceCosts:
        try:
            return self.devices[gpu]
        except KeyError:
            raise SfhpcError(f"the cost model has no GPU type {gpu!r} (it knows: "
                             f"{', '.join(sorted(self.devices))})") from None

    def decode_step_s(self, gpu: str, batch: int) -> float:
        return self.device(gpu).decode_step_s(batch)

    def prefill_s(self, gpu: str, tokens: int) -> float:
        return tokens * self.device(gpu).prefill_per_token_s

    def train_s(self, gpu: str, tokens: int, gpus: int = 1) -> float:
        return tokens * self.device(gpu).train_per_token_s / max(gpus, 1)

    def weight_sync_s(self, receivers: int = 1) -> float:
        hops = math.ceil(math.log2(max(receivers, 1) + 1))
        return self.weight_bytes / (self.sync_gb_s * 1e9) + hops * SYNC_HOP_LATENCY_S

    def staged_load_s(self, gpu: str) -> float:
        """An engine loading a staged version (``engine.staged_updates``) from its second copy in device memory:
        every byte of the weights read once and written once, at the bandwidth a decode step reads them."""
        return 2.0 * self.device(gpu).decode_base_s

    def _state_move_s(self, gpu: str, trainer_gpus: int) -> float:
        return self.trainer_state_bytes / max(trainer_gpus, 1) / (self.device(gpu).host_gb_s * 1e9)

    def lend_s(self, gpu: str, trainer_gpus: int = 1) -> float:
        """A trainer GPU to rollout: its trainer shard to host memory, the engine's weights woken."""
        wake = self.weight_bytes / (self.device(gpu).host_gb_s * 1e9)
        return self._state_move_s(gpu, trainer_gpus) + wake + self.engine_fixed_s

    def reclaim_s(self, gpu: str, trainer_gpus: int = 1) -> float:
        """A lent GPU back to the trainer: the engine to sleep (level 2, nothing copied), the shard back."""
        return self.engine_fixed_s + self._state_move_s(gpu, trainer_gpus)

    def describe(self) -> str:
        lines = [f"cost model ({self.source}): weights {self.weight_bytes / 1e9:.1f} GB, "
                 f"weight sync {self.weight_sync_s():.2f} s"]
        for name, d in sorted(self.devices.items()):
            lines.append(f"  {name}: decode {d.decode_step_s(1) * 1e3:.1f} ms/step at batch 1, "
                         f"{d.tokens_per_s(d.max_batch):,.0f} tok/s at batch {d.max_batch}; "
                         f"train {1 / d.train_per_token_s:,.0f} tok/s per GPU")
        return "\n".join(lines)

    @classmethod
    def published(cls, model: str = "qwen2.5-7b", gpus: Iterable[str] = ("h100", "l40s"),
                  context_tokens: int = 2048) -> CostModel:
        """Costs of `model` on each GPU type from the figures cited above; `context_tokens` is the mean
        context (prompt + reply so far) a decoding sequence holds in the KV cache."""
        spec = MODELS.get(model)
        if spec is None:
            raise SfhpcError(f"unknown model {model!r} for the cost model (known: {', '.join(MODELS)})")
        devices = {}
        for name in gpus:
            gpu = GPUS.get(name)
            if gpu is None:
                raise SfhpcError(f"unknown GPU type {name!r} for the cost model (known: {', '.join(GPUS)})")
            bandwidth = gpu.memory_gb_s * 1e9 * DECODE_BANDWIDTH_EFFICIENCY
            flops = gpu.bf16_tflops * 1e12
            kv_room = gpu.memory_gib * 2**30 * VLLM_MEMORY_UTILIZATION - spec.weight_bytes
            if kv_room <= 0:
                raise SfhpcError(f"{model} does not fit one {name} ({gpu.memory_gib:.0f} GiB); "
                                 "the cost model has no tensor parallelism")
            per_sequence = (spec.kv_bytes_per_token * context_tokens / bandwidth
                            + 2.0 * spec.params / (flops * DECODE_COMPUTE_MFU))
            devices[name] = DeviceCosts(
                decode_base_s=spec.weight_bytes / bandwidth,
                decode_per_sequence_s=per_sequence,
                prefill_per_token_s=2.0 * spec.params / (flops * PREFILL_MFU),
                train_per_token_s=TRAIN_FLOPS_PER_PARAM_TOKEN * spec.params / (flops * TRAIN_MFU),
                max_batch=max(1, min(VLLM_MAX_NUM_SEQS, int(kv_room / (spec.kv_bytes_per_token * context_tokens)))),
                host_gb_s=gpu.host_gb_s,
            )
        return cls(devices, spec.weight_bytes, trainer_state_bytes=TRAINER_STATE_BYTES_PER_PARAM * spec.params,
                   source=f"published figures, {model}")

    @classmethod
    def calibrated_from(cls, rows: Iterable[Mapping[str, Any]], *, trainer_gpus: int, rollout_engines: int,
                        concurrency: int, weight_bytes: float, gpu: str = "cpu",
                        skip_first: bool = True) -> CostModel:
        """Costs measured by a real run: its ``metrics.jsonl`` rows (``trained_tokens``, ``train_s``,
        ``generated_tokens``, ``step_s``, ``sync_s``), on `trainer_gpus` trainer ranks and `rollout_engines`
        engines that each held about `concurrency` sequences. The first step (engine warm-up) is left out.

        Measured: trained tokens/s (over the training time) -> train time per token; generated tokens/s
        (over the step time: engines that wait for the trainer make it an underestimate, so calibrate on an
        ``async`` run) -> the decode step time at `concurrency`; sync time -> the broadcast bandwidth of
        `weight_bytes`. Not measured, kept from the published H100/L40S model (assumed to carry over): how
        decode time splits between the fixed part and the per-sequence part, prefill relative to decode,
        and the lend/reclaim costs' fixed part.
        """
        steady = [r for r in rows if is_training_row(r)][1 if skip_first else 0:]  # not step 0's evaluation
        if not steady:
            raise SfhpcError("calibrating the cost model needs at least one step after the first in metrics.jsonl")
        try:
            trained = sum(float(r["trained_tokens"]) for r in steady)
            train_s = sum(float(r["train_s"]) for r in steady)
            generated = sum(float(r["generated_tokens"]) for r in steady)
            step_s = sum(float(r["step_s"]) for r in steady)
            sync_s = sum(float(r.get("sync_s", 0.0)) for r in steady) / len(steady)
        except (KeyError, TypeError, ValueError) as exc:
            raise SfhpcError(f"metrics.jsonl rows lack a number the cost model needs ({exc})") from None
        if trained <= 0 or train_s <= 0 or generated <= 0 or step_s <= 0:
            raise SfhpcError("the run trained or generated nothing measurable; cannot calibrate the cost model")
        reference = cls.published("qwen2.5-7b", ("l40s",)).device("l40s")
        # The run's decode step at its concurrency, split as the reference GPU splits it.
        step_at_c = concurrency / (generated / step_s / max(rollout_engines, 1))
        shape = reference.decode_step_s(concurrency)
        scale = step_at_c / shape
        device = DeviceCosts(
            decode_base_s=reference.decode_base_s * scale,
            decode_per_sequence_s=reference.decode_per_sequence_s * scale,
            prefill_per_token_s=reference.prefill_per_token_s * scale,
            train_per_token_s=train_s * max(trainer_gpus, 1) / trained,
            max_batch=max(concurrency, 1),
        )
        sync_gb_s = weight_bytes / max(sync_s, 1e-6) / 1e9
        return cls({gpu: device}, weight_bytes, sync_gb_s=sync_gb_s, engine_fixed_s=ENGINE_FIXED_S,
                   trainer_state_bytes=0.0, source=f"calibrated on a run ({len(steady)} steps)")
