"""The layout rules a model's shape sets for a recipe: how its heads and layers split over the parallel ranks.

Each rule is one that the backend would otherwise break on once the GPUs are allocated: megatron's tensor
parallelism splits the query heads and the key/value heads among its ranks, its pipeline the layers among
its stages; vLLM's tensor parallelism splits the query heads, and the key/value heads or, where there are fewer
of them than ranks, replicates each over a whole number of ranks. Pure: read from ``config.json``.
"""

from __future__ import annotations

from sfhpc.config.recipe import Recipe
from sfhpc.plan.memory import ModelShape


def layout_problems(recipe: Recipe, shape: ModelShape) -> list[str]:
    """One line per rule of `shape` that `recipe`'s parallel sizes break."""
    where, found = recipe.source, []
    training = recipe.training
    if training.backend == "megatron":
        tp, pp = training.tensor_parallel, training.pipeline_parallel
        for count, what in ((shape.heads, "attention heads"), (shape.kv_heads, "key/value heads")):
            if count % tp:
                found.append(f"{where}: training.tensor_parallel: {tp} does not divide the model's {count} {what}; "
                             f"use a divisor of {count}")
        if shape.layers % pp:
            found.append(f"{where}: training.pipeline_parallel: {pp} does not divide the model's {shape.layers} layers;"
                         f" use a divisor of {shape.layers}")
    etp = recipe.engine.tensor_parallel_size
    if recipe.engine.name == "vllm":
        if shape.heads % etp:
            found.append(f"{where}: engine.tensor_parallel_size: {etp} does not divide the model's {shape.heads} "
                         f"attention heads (vLLM splits them); use a divisor of {shape.heads}")
        elif shape.kv_heads % etp and etp % shape.kv_heads:
            found.append(f"{where}: engine.tensor_parallel_size: {etp} neither divides the model's {shape.kv_heads} "
                         f"key/value heads nor is a multiple of them (vLLM splits or replicates them)")
    return found
