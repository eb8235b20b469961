"""The OpenAI-compatible API server (FastAPI); never imports JAX. It reaches the engine-core
process through jaxserve/engine/core_client.py.

    protocol.py          request / response bodies (pydantic)
    serving*.py          the completions and chat endpoints
    chat_tools.py        a chat request's tools: tool_choice, its grammar, template messages
    chat_output.py       a chat reply split into reasoning, content and tool calls (streamed)
    tool_parsers.py      --tool-call-parser: hermes/qwen, llama3_json, mistral
    reasoning_parsers.py --reasoning-parser: deepseek_r1, qwen3 (<think>...</think>)
    app.py               routes and errors
    debug_routes.py      /debug: the map page, live counters, request traces, diagnose
    trace_store.py       recent request traces and the live counters behind /debug
    symptoms.py          symptom -> box findings from traces and counters
    otel.py              --otlp-traces-endpoint: traces as OpenTelemetry spans
    metrics.py           Prometheus metrics (vLLM's names, `jaxserve:` prefix)
    server.py            engine process + readiness handshake + uvicorn
"""
