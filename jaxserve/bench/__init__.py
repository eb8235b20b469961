"""Benchmarks: `python -m jaxserve.bench throughput ...` (offline)."""
