"""The OpenAI-compatible API server (FastAPI); never imports JAX.

    protocol.py          request / response bodies (pydantic)
    engine_client.py     ZeroMQ to the engine-core process, output routing, liveness
    serving*.py          the completions and chat endpoints
    app.py               routes and errors
    metrics.py           Prometheus metrics (vLLM's names, `jaxserve:` prefix)
    server.py            engine process + readiness handshake + uvicorn
"""
