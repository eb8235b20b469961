"""Benchmarks: `python -m jaxserve.bench throughput ...` (offline) and
`python -m jaxserve.bench serve ...` (online, against an OpenAI-compatible server)."""
