"""Bodies of the routes beside generation: /v1/models, vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from jaxserve.api_server.protocol import (
    ChatMessage,
    ChatTool,
    OpenAIBaseModel,
    OpenAIRequest,
    Text,
    TokenId,
    check_generation_prompt,
)


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIRequest):
    """vLLM's /tokenize: either `prompt` (completion style) or `messages` (chat style)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    # vLLM's chat-style fields, rendered as the chat endpoint renders them.
    continue_final_message: bool = False
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    chat_template: Text | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[Text, Any] | None = None
    return_token_strs: bool = False

    _check_generation_prompt = model_validator(mode="before")(check_generation_prompt)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
