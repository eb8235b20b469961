"""What the engine client records for operators (vLLM's `v1/metrics/`): Prometheus metrics
with vLLM's names (`prometheus.py`) and recent requests' box-by-box traces for /debug
(`trace_store.py`). JAX-free; the API server serves them, the engine client fills them."""
