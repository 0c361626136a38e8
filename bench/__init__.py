"""Benchmarks: run each from the repository root as ``python -m bench.<name>``; each prints its figures."""
