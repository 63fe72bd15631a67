"""Benchmarks: the figures of merit, one command each (python -m sfhpc.bench.NAME)."""
