"""Benchmarks of ours against the alternatives, run from the repository root: ``python -m benchmarks.bench_tp``."""
