"""Configuration: recipes and cluster tag maps, loaded from YAML into frozen dataclasses."""

from sfhpc.config.cluster import ClusterMap, Pool, load_cluster_map
from sfhpc.config.recipe import Recipe, Role, load_recipe

__all__ = ["ClusterMap", "Pool", "Recipe", "Role", "load_cluster_map", "load_recipe"]
