"""The launch plan: a recipe's roles placed on a cluster map (components and rank slots)."""
