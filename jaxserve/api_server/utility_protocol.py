"""Bodies of the routes beside generation: /v1/models, vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from jaxserve.api_server.protocol import ChatMessage, OpenAIBaseModel, OpenAIRequest, Text, TokenId


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
    return_token_strs: bool = False


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
