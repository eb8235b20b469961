"""The OpenAI-compatible API server (FastAPI); never imports JAX. It reaches the engine-core
process through an `EngineClient` (jaxserve/engine/protocol.py).

    protocol.py          completions and chat request / response bodies (pydantic)
    responses_protocol.py, utility_protocol.py
                         the Responses API's bodies; /v1/models, /tokenize, /detokenize
    unsupported_fields.py vLLM's request fields jaxserve refuses unless default
    serving*.py          the completions, chat and Responses endpoints (Responses: a
                         translation of the chat path)
    chat_tools.py        a chat request's tools: tool_choice, its grammar, template messages
    chat_output.py       a chat reply split into reasoning, content and tool calls (streamed)
    tool_parsers.py      --tool-call-parser: hermes/qwen, llama3_json, mistral, openai
                         (GPT-OSS's harmony)
    harmony.py           GPT-OSS's harmony messages read from the text (openai and
                         openai_gptoss parse them)
    reasoning_parsers.py --reasoning-parser: deepseek_r1, qwen3 (<think>...</think>),
                         openai_gptoss (GPT-OSS's harmony channels)
    app.py               the app: its routers, middleware and error handlers
    *_routes.py          one APIRouter per API: openai (completions, chat), responses,
                         messages (Anthropic), pooling (embeddings, score, rerank,
                         classify), sagemaker (/invocations), utility (/v1/models,
                         /tokenize), admin (/health, /version, /metrics), debug (/debug: the
                         map page, live counters, request traces, diagnose)
    route_utils.py       errors in the calling API's shape, cancelling on disconnect
    middleware.py        the API key check and the body size limit
    symptoms.py          symptom -> box findings from traces and counters
    otel.py              --otlp-traces-endpoint: traces as OpenTelemetry spans
    server.py            engine process + readiness handshake + uvicorn

The metrics and request traces it serves live in jaxserve/metrics/ (the engine client fills
them).
"""
