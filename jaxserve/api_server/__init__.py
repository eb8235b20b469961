"""The OpenAI-compatible API server (FastAPI); never imports JAX.

    protocol.py          request / response bodies (pydantic)
    engine_client.py     ZeroMQ to the engine-core process, output routing, liveness
    serving*.py          the completions and chat endpoints
    chat_tools.py        a chat request's tools: tool_choice, its grammar, template messages
    chat_output.py       a chat reply split into reasoning, content and tool calls (streamed)
    tool_parsers.py      --tool-call-parser: hermes/qwen, llama3_json, mistral
    reasoning_parsers.py --reasoning-parser: deepseek_r1, qwen3 (<think>...</think>)
    app.py               routes and errors
    metrics.py           Prometheus metrics (vLLM's names, `jaxserve:` prefix)
    server.py            engine process + readiness handshake + uvicorn
"""
