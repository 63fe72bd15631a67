"""The memory plan of a run: every trainer and engine rank of a recipe placed on a cluster, in bytes.

Each rank's items come from `sfhpc.plan.memory` (the model's ``config.json`` and the recipe's training
settings); this module finds the ranks in the launch plan, what each one holds (a trainer, an engine, or
both on one GPU: a colocated ``sync`` recipe, or a trainer lent to rollout in ``seamless``) and what it has:
its GPU (the cluster map's ``gpu_memory_gib``, of which `USABLE_SHARE` is usable; a pool that does not say
is printed, not checked) or, for a CPU rank, its node's memory over the ranks on it. Two rules follow:

* before any job starts (`memory_problems`, from the plan): a rank whose items exceed what it has is refused
  in one line that gives the numbers and what to change;
* when an engine starts beside a trainer (`engine_memory_share`): vLLM's ``gpu_memory_utilization`` is a share
  of the whole GPU that must be free at its start, so on a shared GPU it is cut to what the trainer left, as
  measured then.

Pure: no torch, no CUDA. The numbers a user sees come from here (`sfhpc plan`, `sfhpc check`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sfhpc.config.cluster import ClusterMap, Pool
from sfhpc.config.recipe import Recipe
from sfhpc.plan.launch_plan import LaunchPlan
from sfhpc.plan.memory import (
    DTYPE_BYTES,
    ENGINE_RESERVE,
    GIB,
    USABLE_SHARE,
    MegatronSettings,
    ModelShape,
    RankMemory,
    TrainerSetup,
    advice,
    engine_items,
    equal_micro_batches,
    gib,
    lora_params,
    megatron_memory,
    micro_batch_tokens,
    teacher_memory,
    trainer_memory,
)


@dataclasses.dataclass(frozen=True)
class PlannedRank:
    """One kind of rank of the run (all ranks of a role on one pool hold the same) and its memory."""

    role: str  # "trainer", "trainer + engine", "engine"
    pool: str
    ranks: int
    on_gpu: bool
    memory: RankMemory

    def describe(self) -> str:
        where = "GPU" if self.on_gpu else "node memory share"
        return f"{self.memory.describe()} [{self.ranks} rank(s) on pool '{self.pool}', {where}]"


def model_shape(recipe: Recipe) -> ModelShape | None:
    """The shape of the recipe's model folder; None for a model sfhpc builds (small by construction) or a
    folder whose config says too little (the model folder's own check names what is wrong with it)."""
    if recipe.model.path is None:
        return None
    try:
        return ModelShape.from_folder(Path(recipe.model.path))
    except (OSError, ValueError):
        return None


def rows_per_trainer(recipe: Recipe, data_parallel: int) -> int:
    """The rows one data-parallel trainer rank trains per step: its share of the step's answers."""
    rows = recipe.budgets.prompts_per_step * recipe.algorithm.group_size
    return max(1, -(-rows // max(data_parallel, 1)))


def planned_ranks(recipe: Recipe, plan: LaunchPlan, cluster: ClusterMap) -> list[PlannedRank]:
    """Every kind of trainer, engine and teacher rank of the run with its memory; none of the policy's when the
    model is sfhpc's own."""
    if recipe.training.backend == "timing":  # a timing model holds no model
        return []
    pools = {p.name: p for p in cluster.pools}
    shape = model_shape(recipe)
    if shape is None:
        return _teachers(recipe, plan, pools)
    slots = plan.ranks()
    trainers = [s for s in slots if "trainer" in s.roles]
    lending = recipe.pipeline.mode == "seamless"
    out = []
    for pool_name in sorted({s.pool for s in trainers}):
        pool = pools[pool_name]
        here = [s for s in trainers if s.pool == pool_name]
        shares = any("rollout" in s.roles or (lending and "rollout" in s.tags) for s in here)
        on_gpu = recipe.role("trainer").gpus_per_task > 0  # type: ignore[union-attr]
        memory = _trainer(recipe, shape, len(trainers), on_gpu, _capacity(recipe, pool, on_gpu, "trainer"))
        if shares and on_gpu:
            memory = dataclasses.replace(memory, items=memory.items + tuple(_engine(recipe, shape)))
        out.append(PlannedRank("trainer + engine" if shares and on_gpu else "trainer", pool_name, len(here), on_gpu,
                               memory))
    rollout = recipe.role("rollout")
    if rollout is not None and rollout.owns_nodes and rollout.gpus_per_task > 0:
        for pool_name in sorted({s.pool for s in slots if "rollout" in s.roles and "trainer" not in s.roles}):
            pool = pools[pool_name]
            capacity = int(pool.gpu_memory_gib * GIB * recipe.engine.gpu_memory_utilization)
            count = sum(1 for s in slots if s.pool == pool_name and "rollout" in s.roles)
            out.append(PlannedRank("engine", pool_name, count, True,
                                   RankMemory("engine", tuple(_engine(recipe, shape)), capacity)))
    return out + _teachers(recipe, plan, pools)


def teacher_shape(recipe: Recipe) -> ModelShape | None:
    """The shape of ``algorithm.distill.teacher`` (a model folder, or the model folder of the run it names);
    None without distillation or where no config.json says it before the run."""
    distill = recipe.algorithm.distill
    if distill is None:
        return None
    source = Path(distill.teacher)
    for folder in (source, source / "model", source.parent.parent / "model"):  # a folder, a run, a checkpoint
        if (folder / "config.json").is_file():
            try:
                return ModelShape.from_folder(folder)
            except (OSError, ValueError):
                return None
    return None


def _teachers(recipe: Recipe, plan: LaunchPlan, pools: dict[str, Pool]) -> list[PlannedRank]:
    """The teacher ranks on GPUs, each holding the teacher and scoring one micro-batch at a time."""
    teacher, shape = recipe.role("teacher"), teacher_shape(recipe)
    if teacher is None or shape is None or teacher.gpus_per_task == 0:
        return []
    slots = [s for s in plan.ranks() if "teacher" in s.roles]
    training = recipe.training
    tokens = micro_batch_tokens(training.micro_batch_tokens, rows_per_trainer(recipe, len(slots)),
                                recipe.model.max_seq_len)
    out = []
    for pool_name in sorted({s.pool for s in slots}):
        memory = teacher_memory(shape, on_gpu=True, micro_batch_tokens=tokens,
                                chunk_tokens=training.logprob_chunk_tokens,
                                capacity=_capacity(recipe, pools[pool_name], True, "teacher"))
        out.append(PlannedRank("teacher", pool_name, sum(1 for s in slots if s.pool == pool_name), True, memory))
    return out


def _trainer(recipe: Recipe, shape: ModelShape, trainer_ranks: int, on_gpu: bool, capacity: int) -> RankMemory:
    training, length = recipe.training, recipe.model.max_seq_len
    reference = recipe.algorithm.kl_coef != 0
    if training.backend == "megatron":
        data = trainer_ranks // (training.tensor_parallel * training.pipeline_parallel)
        rows = rows_per_trainer(recipe, data)
        count = equal_micro_batches(rows, length, training.micro_batch_tokens, training.pipeline_parallel)
        settings = MegatronSettings.from_training(training, tensor=training.tensor_parallel, data=data, on_gpu=on_gpu)
        return megatron_memory(shape, settings, tensor_parallel=training.tensor_parallel,
                               pipeline_parallel=training.pipeline_parallel, data_parallel=data,
                               tokens=rows // count * length, in_flight=min(count, training.pipeline_parallel),
                               reference=reference, capacity=capacity, device="gpu" if on_gpu else "cpu")
    rows = rows_per_trainer(recipe, trainer_ranks)
    tokens = micro_batch_tokens(training.micro_batch_tokens, rows, length)
    lora = recipe.model.lora
    setup = TrainerSetup(ranks=trainer_ranks,
                         sharded=training.shards(trainer_ranks, on_gpu=on_gpu, lora=lora is not None),
                         precision=training.compute_precision(on_gpu=on_gpu), micro_batch_tokens=tokens,
                         activation_checkpointing=training.activation_checkpointing,
                         logprob_chunk_tokens=training.logprob_chunk_tokens, reference=reference,
                         device="gpu" if on_gpu else "cpu",
                         lora_params=0 if lora is None else lora_params(shape, lora.rank, lora.target_modules))
    return trainer_memory(shape, setup, capacity)


def _engine(recipe: Recipe, shape: ModelShape) -> list[tuple[str, int]]:
    return engine_items(shape, dtype_bytes=DTYPE_BYTES.get(recipe.model.dtype, 2),
                        tensor_parallel=recipe.engine.tensor_parallel_size, max_seq_len=recipe.model.max_seq_len)


def _capacity(recipe: Recipe, pool: Pool, on_gpu: bool, role_name: str) -> int:
    """What one rank of `role_name` has on `pool` (0: not known, not checked)."""
    if on_gpu:
        return int(pool.gpu_memory_gib * GIB * USABLE_SHARE)
    role = recipe.role(role_name)  # type: ignore[arg-type]
    ranks_on_node = role.tasks_per_node if role is not None and role.owns_nodes else 1
    return pool.memory_mb * (1 << 20) // max(ranks_on_node, 1)


@dataclasses.dataclass(frozen=True)
class WeightCopy:
    """The second copy of the weights each rollout rank of a pool keeps beside its engine's, and where it lies."""

    why: str      # the recipe key that asks for it: engine.weight_delta, engine.staged_updates, engine.max_restarts
    pool: str
    nbytes: int
    on_gpu: bool  # in the GPU's memory beside vLLM's share (torch transport), else in host memory
    room: int     # on a GPU: the bytes beside vLLM's share (0: the cluster map does not say)
    share: float  # vLLM's gpu_memory_utilization
    gpu: int      # the GPU's bytes

    @property
    def fits(self) -> bool:
        return not self.on_gpu or not self.gpu or self.nbytes <= self.room

    def describe(self) -> str:
        where = (f"in its GPU's memory beside vLLM's share ({gib(self.room)} there)" if self.on_gpu and self.gpu
                 else "in its GPU's memory beside vLLM's share" if self.on_gpu else "in host memory")
        return (f"{self.why}: each rollout rank on pool '{self.pool}' keeps a copy of the weights ({gib(self.nbytes)}) "
                f"{where}" + ("" if self.fits else ": does not fit"))


def weight_copies(recipe: Recipe, plan: LaunchPlan, cluster: ClusterMap) -> list[WeightCopy]:
    """A rollout rank that keeps a second copy of the weights beside its engine's, per pool: the rank's with
    ``engine.weight_delta`` or ``engine.max_restarts`` (what a delta applies to, what a restarted engine loads),
    the engine's own with ``engine.staged_updates`` (a version received while the engine generates). Under the
    torch transport on GPUs the copy lies in the GPU's memory beside vLLM's share, else in host memory. Empty for
    the test engine, and where the model is sfhpc's own."""
    rollout, engine = recipe.role("rollout"), recipe.engine
    why = next((key for key, on in (("weight_delta", engine.weight_delta), ("staged_updates", engine.staged_updates),
                                    ("max_restarts", engine.max_restarts > 0)) if on), None)
    shape = model_shape(recipe)
    if why is None or rollout is None or engine.name != "vllm" or shape is None:
        return []
    pools = {p.name: p for p in cluster.pools}
    on_gpu = engine.weight_transport != "mpi" and rollout.gpus_per_task > 0
    copies = []
    for pool_name in sorted({s.pool for s in plan.ranks() if "rollout" in s.roles}):
        gpu = int(pools[pool_name].gpu_memory_gib * GIB) if on_gpu else 0
        copies.append(WeightCopy(f"engine.{why}", pool_name, shape.params * DTYPE_BYTES.get(recipe.model.dtype, 2),
                                 on_gpu, int(gpu * (USABLE_SHARE - engine.gpu_memory_utilization)),
                                 engine.gpu_memory_utilization, gpu))
    return copies


def weight_copy_problem(recipe: Recipe, plan: LaunchPlan, cluster: ClusterMap) -> str | None:
    """The line that refuses a copy of the weights (`weight_copies`) without room beside vLLM's share."""
    for copy in weight_copies(recipe, plan, cluster):
        if not copy.fits:
            room = max(0.0, USABLE_SHARE - copy.nbytes / copy.gpu)
            return (f"{copy.why}: each rollout rank on pool '{copy.pool}' keeps a copy of the weights "
                    f"({gib(copy.nbytes)}) in its GPU's memory under the torch transport, beside vLLM's share "
                    f"(gpu_memory_utilization {copy.share:g} of {gib(copy.gpu)}): lower engine.gpu_memory_utilization "
                    f"to at most {room:.2f}, or set engine.weight_transport: mpi (the copy then lives in host memory)")
    return None


def memory_problems(recipe: Recipe, plan: LaunchPlan, cluster: ClusterMap) -> list[str]:
    """One line per kind of rank whose plan does not fit what it has."""
    problems = [line] if (line := weight_copy_problem(recipe, plan, cluster)) else []
    for rank in planned_ranks(recipe, plan, cluster):
        if rank.memory.fits:
            continue
        has = (f"its GPU's {gib(rank.memory.capacity)} (the cluster map's gpu_memory_gib, {USABLE_SHARE:.0%} usable"
               + (f", gpu_memory_utilization {recipe.engine.gpu_memory_utilization:g}" if rank.role == "engine" else "")
               + ")") if rank.on_gpu else f"its share of the node's memory, {gib(rank.memory.capacity)}"
        parts = ", ".join(f"{name} {b / GIB:.1f}" for name, b in rank.memory.items if b)
        key = {"engine": "roles.rollout", "teacher": "roles.teacher"}.get(rank.role, "roles.trainer")
        problems.append(f"{key}: a {rank.role} rank on pool '{rank.pool}' needs {gib(rank.memory.total)} > {has} "
                        f"({parts} GiB): {advice(rank.memory)}")
    return problems


def engine_memory_share(wanted: float, free_bytes: int, total_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization`` for an engine starting on a GPU another process (the trainer) uses:
    the recipe's share, cut to what is free now less the reserve (vLLM refuses to start when the share it is
    given is not free). Raises ValueError when not even the reserve is free."""
    available = (free_bytes - ENGINE_RESERVE) / total_bytes
    if available <= 0:
        raise ValueError(f"only {free_bytes / GIB:.1f} GiB of the GPU's {total_bytes / GIB:.1f} GiB are free: no room "
                         "for an engine beside the trainer")
    return min(wanted, round(available, 3))
