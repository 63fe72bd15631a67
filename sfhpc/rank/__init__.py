"""The program every rank runs: the launch report, then the recipe's roles (the RL loop)."""
