"""Anthropic's Messages API bodies (POST /v1/messages, POST /v1/messages/count_tokens).

Content blocks and tools stay loose dicts here, as in responses_protocol.py: the translation to a
chat request (jaxserve/api_server/serving_messages.py) reads the block types jaxserve serves and
refuses the others with a 400 naming them. Errors use Anthropic's envelope
({"type": "error", "error": {"type", "message"}}), not OpenAI's.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Field

from jaxserve.api_server.protocol import INT32_MAX, OpenAIRequest, Text, WholeInt

# Anthropic's error types by status (its documented table; 503 is ours: the engine is gone).
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def anthropic_error_body(message: str, status: HTTPStatus) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def anthropic_error_response(message: str, status: HTTPStatus) -> JSONResponse:
    return JSONResponse(anthropic_error_body(message, status), status_code=int(status))


class MessageParam(OpenAIRequest):
    # "system": Claude Code's mid-conversation system messages (a beta of Anthropic's).
    role: Literal["user", "assistant", "system"]
    content: Text | list[dict[str, Any]]


class CountTokensRequest(OpenAIRequest):
    """POST /v1/messages/count_tokens: a Messages body without max_tokens."""

    model: Text
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: Text | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: dict[str, Any] | None = None
    # {"type": "enabled", "budget_tokens": N} | {"type": "adaptive"} | {"type": "disabled"}
    thinking: dict[str, Any] | None = None
    # Sent by Claude Code and Anthropic's SDKs; accepted and ignored: they steer Anthropic's
    # own service (context editing, effort, caching, tiers, speed, regions, containers, MCP).
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: Text | None = None
    speed: Text | None = None
    inference_geo: Text | None = None
    diagnostics: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: list[dict[str, Any]] | None = None
    betas: list[Text] | None = None
    user_profile_id: Text | None = None
    workspace_id: Text | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. `max_tokens` is required, as Anthropic requires it."""

    max_tokens: Annotated[WholeInt, Field(ge=1, le=INT32_MAX)]
    stop_sequences: list[Text] | None = None
    stream: bool = False
    # Older SDKs send these; the current one has them in extra_body only.
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[WholeInt, Field(ge=0, le=INT32_MAX)] | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}; logged nowhere, echoed nowhere
