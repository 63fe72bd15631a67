"""Launch: recipe + tag map -> heterogeneous Slurm job (or a local mpiexec run)."""
