"""Benchmarks: ``python -m mamba2_rocm bench <op>``. Ratios measured in one run, never asserted."""
