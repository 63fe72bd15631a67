"""sfhpc: Slurm-native reinforcement learning of language-model agents (SeamlessFlow for HPC centres)."""

__version__ = "0.1.0"
