"""OpenAI's Responses API bodies (POST /v1/responses), as vLLM serves them.

Input items and tools stay loose dicts here (the Responses API has many item types); the
translation to a chat request (jaxserve/api_server/serving_responses.py) reads the ones jaxserve
serves and refuses the others with a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from jaxserve.api_server.protocol import (
    INT32_MAX,
    OpenAIBaseModel,
    SamplingRequestFields,
    Text,
    WholeInt,
)


class ResponsesRequest(SamplingRequestFields):
    """POST /v1/responses. vLLM's sampling fields ride along (`extra_body`), as in chat."""

    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: Annotated[WholeInt, Field(ge=1, le=INT32_MAX)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | "json_object"}}
    store: bool | None = None  # unset: true, OpenAI's default (kept, if the server keeps any)
    background: bool | None = False
    previous_response_id: Text | None = None
    # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)],
                             Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    # Accepted and echoed; jaxserve has no reasoning-effort knob (the model thinks or not).
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Accepted; reasoning items carry `encrypted_content: null` (nothing is encrypted: the
    # reasoning text is in their content). The other values ask for nothing jaxserve adds.
    include: list[Text] | None = None
    # Set, or with include "message.output_text.logprobs": each output token's logprob and
    # this many alternatives (chat's logprobs / top_logprobs).
    top_logprobs: Annotated[WholeInt, Field(ge=0, le=20)] | None = None
    # Sent by Codex and the OpenAI SDK; accepted and ignored (the prefix cache needs no key).
    prompt_cache_key: Text | None = None
    client_metadata: dict[str, Any] | None = None
    safety_identifier: Text | None = None
    service_tier: Text | None = None


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)],
                             Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    background: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    user: str | None = None

