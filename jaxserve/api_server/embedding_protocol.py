"""Bodies of POST /v1/embeddings (OpenAI's, with vLLM's extra fields), vLLM's /pooling and
/classify."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from jaxserve.api_server.protocol import (
    INT32_MAX,
    ChatMessage,
    Int64,
    NonEmptyText,
    OpenAIBaseModel,
    OpenAIRequest,
    Text,
    TokenId,
    UsageInfo,
    WholeInt,
    check_generation_prompt,
    random_uuid,
)

# OpenAI's cap on inputs per request (clients such as langchain batch up to it).
MAX_INPUTS = 2048


class PoolingInputRequest(OpenAIRequest):
    """What every pooling request (embeddings, /pooling, /classify) takes as its prompts:
    `input`, or chat `messages` (the chat template applied: one prompt); `use_activation`
    (None: the task's default), `truncate_prompt_tokens` / `truncation_side` (as in
    completions), `add_special_tokens`, `priority`."""

    model: Text | None = None
    # Non-empty in the schema too, so schema-driven clients (and fuzzers) know it.
    input: (Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                        Field(min_length=1, max_length=MAX_INPUTS)]
            | NonEmptyText
            | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]
            | None) = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # vLLM's chat-style embedding: the template as vLLM applies it for pooling.
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    user: Text | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=-1, le=INT32_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    priority: Int64 = 0

    _check_generation_prompt = model_validator(mode="before")(check_generation_prompt)


class EmbeddingRequest(PoolingInputRequest):
    """OpenAI's embeddings request; vLLM's extras: `normalize` (the older name of
    use_activation; None: --pooler-config's), `embed_dtype` and `endianness` (base64's bytes)."""

    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    dimensions: Annotated[WholeInt, Field(ge=1)] | None = None
    normalize: bool | None = None


# vLLM's pooling tasks: any of them is a well-formed /pooling request, and one the served
# model does not serve is refused naming it ("Unsupported task: ..."), as vLLM refuses it.
PoolingTask = Literal["embed", "classify", "token_embed", "token_classify", "plugin",
                      "embed&token_classify"]
# Tasks vLLM removed, refused in its words.
REMOVED_POOLING_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: an embeddings request with the pooling `task` (None: classify for a
    classifier, embed for any other model; token_embed: a vector per prompt token)."""

    task: PoolingTask | None = None

    @field_validator("task", mode="before")
    @classmethod
    def _removed_task(cls, value: Any) -> Any:
        if isinstance(value, str) and value in REMOVED_POOLING_TASKS:
            raise ValueError(REMOVED_POOLING_TASKS[value])
        return value


class ClassificationRequest(PoolingInputRequest):
    """vLLM's /classify: each input's class probabilities (use_activation false: logits)."""


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | list[list[float]] | str


class PoolingResponse(OpenAIBaseModel):
    """vLLM's /pooling answer: the same vectors as /v1/embeddings under `data`."""

    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None  # the most probable class's name (config.json's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
