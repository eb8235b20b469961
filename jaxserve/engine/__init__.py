"""The engine: what sits between a user's request and the engine core (vLLM's `v1/engine/`).

    build.py             assembly of one engine core in this process: worker + scheduler +
                         EngineCore (the offline `LLM`, the engine-core process)
    core_process.py      the engine-core process: ZeroMQ in, `EngineCore` steps, ZeroMQ out
    messages.py          the messages between the API server and that process
    protocol.py          `EngineClient`: the engine as the API server codes against it
    core_client.py       `AsyncMPClient`: the API server's client of the engine-core process
                         (ZeroMQ, liveness)
    dp_client.py         `DPLBAsyncMPClient`: one client over several engine-core processes
                         (data parallelism, least-loaded routing)
    output_processor.py  token ids -> text, stop strings, RequestOutputs (offline and server)

Only `build.py` and `core_process.py` reach the worker (JAX); the rest is JAX-free and used by
the API server (tests/test_import_rules.py checks it). Nothing is imported here, so that
importing one module does not pull in the others.
"""
