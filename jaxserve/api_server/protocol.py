"""OpenAI's request and response bodies (with vLLM's extra sampling fields), as pydantic models.

Requests are checked here before anything else looks at them, each failure a 400 naming the
field: strict types (`max_tokens: true` or `stream: "yes"` are errors, not coerced), every
integer inside the range the engine can carry (int64, or tighter), valid Unicode in every
string (a lone surrogate cannot be tokenized), and OpenAI's cap on `n`. Finer value rules
(top_p in (0, 1], ...) are SamplingParams', whose ValueErrors name the field too.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from jaxserve.api_server.unsupported_fields import UnsupportedVllmFields
from jaxserve.sampling_params import MAX_BAD_WORD_SEQUENCES, MAX_LOGPROBS

logger = logging.getLogger("jaxserve.api_server")

# Largest values the engine carries: int64 through msgpack and the scheduler, int32 for what
# lands in the worker's arrays.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

MAX_N = 128  # OpenAI's cap on choices per request


def random_uuid() -> str:
    return uuid.uuid4().hex


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("invalid Unicode (a lone surrogate)") from None
    return s


def _whole(v: Any) -> Any:
    # JSON Schema's integer includes 4.0 (and schema-driven clients send it); 4.5, true and
    # "4" stay errors.
    return int(v) if isinstance(v, float) and v.is_integer() else v


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
WholeInt = Annotated[int, BeforeValidator(_whole)]
Int64 = Annotated[WholeInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[WholeInt, Field(ge=0, le=INT32_MAX)]
TokenId = Annotated[WholeInt, Field(ge=0, le=INT32_MAX)]


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


# vLLM's sentence (chat, pooling and /tokenize requests): the two ask for opposite prompts.
BOTH_GENERATION_PROMPTS = ("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.")


def check_generation_prompt(data: Any) -> Any:
    """A model validator (before): refuses a body that sets both continue_final_message and
    add_generation_prompt, in vLLM's words."""
    if (isinstance(data, dict) and data.get("continue_final_message") is True
            and data.get("add_generation_prompt") is True):
        raise ValueError(BOTH_GENERATION_PROMPTS)
    return data


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as vLLM and OpenAI do.
    model_config = ConfigDict(extra="ignore")


class OpenAIRequest(OpenAIBaseModel):
    """A request body: strict types (no silent coercion of a client's mistakes). Unknown
    fields are ignored with a warning naming them (vLLM's), not silently."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> OpenAIRequest:
        if self.model_extra:
            names = sorted(self.model_extra)
            shown = ", ".join(repr(n)[:40] for n in names[:20])
            logger.warning("%s: ignored unknown fields %s%s", type(self).__name__, shown,
                           f" and {len(names) - 20} more" if len(names) > 20 else "")
        return self


# --- errors ---------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --- shared pieces --------------------------------------------------------------------


class StreamOptions(OpenAIRequest):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool | None = False

    @property
    def usage_on_every_chunk(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int | None = None  # the prompt tokens the prefix cache served
    # vLLM's other two: jaxserve creates no cache entries a client pays for and takes no
    # multimodal input, so both are null, as vLLM's are for such a request.
    created_cache_tokens: int | None = None
    multimodal_tokens: dict[str, int] | None = None


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    """vLLM's usage, field for field. A whole response carries all five (the details null
    unless reported); a stream chunk carries vLLM's smaller shapes (see `streamed`)."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    # With --enable-prompt-tokens-details (vLLM's), or for the Messages and Responses APIs.
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    def streamed(self, final: bool, chat: bool) -> dict[str, Any]:
        """The usage as a stream chunk carries it in vLLM. The final usage chunk drops every
        null (vLLM dumps it with exclude_none). A chunk with continuous_usage_stats has the
        three counts only (vLLM dumps it with exclude_unset; its chat also sets
        completion_tokens_details, null without a reasoning parser); the prompt's details
        stay when reported, which the Messages API's message_start reads its cached tokens
        from."""
        if final:
            return _drop_none(self.model_dump())
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens,
                               "completion_tokens": self.completion_tokens,
                               "total_tokens": self.total_tokens}
        if chat:
            out["completion_tokens_details"] = (None if self.completion_tokens_details is None
                                                else self.completion_tokens_details.model_dump())
        if self.prompt_tokens_details is not None:
            out["prompt_tokens_details"] = _drop_none(self.prompt_tokens_details.model_dump())
        return out


def _drop_none(value: Any) -> Any:
    """`value` without its null entries, at every depth (pydantic's exclude_none)."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


class StreamResponse(OpenAIBaseModel):
    """A stream chunk (its subclasses declare `choices` and `usage`) in vLLM's shape: `usage`
    only on the chunks that carry it (absent, not null, from the others), in the shape of
    `UsageInfo.streamed`; the final usage chunk (no choices) without any null field, as
    vLLM dumps it."""

    chat_usage: ClassVar[bool] = False  # chat's continuous usage has completion_tokens_details

    @model_serializer(mode="wrap")
    def _vllm_chunk(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        usage: UsageInfo | None = getattr(self, "usage", None)
        if "usage" not in data:  # excluded by the caller
            return data
        if usage is None:
            del data["usage"]
        elif not getattr(self, "choices", None):
            data = _drop_none(data)
            data["usage"] = usage.streamed(final=True, chat=self.chat_usage)
        else:
            data["usage"] = usage.streamed(final=False, chat=self.chat_usage)
        return data


class JsonSchemaFormat(OpenAIRequest):
    name: Text | None = None
    description: Text | None = None
    # Named `schema` on the wire (OpenAI's); `schema_` here: BaseModel has a `schema` method.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIRequest):
    """vLLM's `structured_outputs` (extra_body): exactly one of these."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class SamplingRequestFields(UnsupportedVllmFields, OpenAIRequest):
    """The sampling fields shared by completions and chat completions (vLLM's names)."""


    model: Text | None = None
    n: Annotated[WholeInt, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: Annotated[WholeInt, Field(ge=-1, le=INT32_MAX)] | None = None  # and <= vocab (serving)
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    # Bounded before tokenizing: each word makes at least one of the request's sequences.
    bad_words: Annotated[list[Annotated[NonEmptyText, Field(max_length=1000)]],
                         Field(max_length=MAX_BAD_WORD_SEQUENCES)] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    # Per prompt token (but the first), its logprob and the top-N.
    prompt_logprobs: Annotated[WholeInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's
    # older guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # vLLM's: the prompt's and the output's token ids beside the text (completions and chat).
    return_token_ids: bool | None = None
    # vLLM's: keep k of the prompt's tokens (-1: as many as leave room for one output token),
    # the last k ("left", the default: the start is cut) or the first ("right").
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=-1, le=INT32_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprobs name each token "token_id:N" (a token that is not valid UTF-8 alone
    # stays unambiguous).
    return_tokens_as_token_ids: bool | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys_are_token_ids(cls, value: dict[str, float] | None
                                       ) -> dict[str, float] | None:
        """Every key that is not a token id, named at once (vLLM's words); the others in
        their canonical spelling (" 5" is token 5, as int() reads it in vLLM)."""
        if not value:
            return value
        bad = [key for key in value if _as_int(key) is None]
        if bad:
            raise ValueError("logit_bias contains key(s) that cannot be converted to integer "
                             f"token IDs: {bad!r}")
        ids = {key: _as_int(key) for key in value}
        negative = [i for i in ids.values() if i is not None and i < 0]
        if negative:
            raise ValueError(f"token_id(s) {negative} in logit_bias contain out-of-vocab token "
                             "ids (token ids are never negative)")
        return {str(ids[key]): bias for key, bias in value.items()}

    @field_validator("stream_options")
    @classmethod
    def _stream_options_only_when_streaming(cls, value: StreamOptions | None,
                                            info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")  # vLLM's words
        return value


# --- completions ----------------------------------------------------------------------


class CompletionRequest(SamplingRequestFields):
    # Non-empty in the schema too, so schema-driven clients (and fuzzers) know it.
    prompt: (Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
             | NonEmptyText
             | Annotated[list[NonEmptyText], Field(min_length=1)])
    # 0 only with echo: the prompt scored, nothing generated (vLLM's; evaluation harnesses).
    max_tokens: Annotated[WholeInt, Field(ge=0, le=INT32_MAX)] | None = 16
    echo: bool | None = False
    logprobs: Annotated[WholeInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Text | None = None
    best_of: Annotated[WholeInt, Field(ge=1, le=MAX_N)] | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class LogprobInfo(OpenAIBaseModel):
    """vLLM's Logprob as its prompt_logprobs carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: list[dict[int, LogprobInfo] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the output's (a stream: new ones)
    prompt_token_ids: list[int] | None = None  # return_token_ids (a stream: first chunk)


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    # OpenAI's fields jaxserve has no value for, sent as null (vLLM's): a client that
    # compares bodies key for key (the SDK's object against /invocations') finds them.
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo


class CompletionStreamResponse(StreamResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# --- chat completions -----------------------------------------------------------------


class ContentPart(OpenAIRequest):
    """One of OpenAI's content parts; only {"type": "text", "text": ...} is served."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Text
    text: Text | None = None


class FunctionCallParam(OpenAIRequest):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallParam(OpenAIRequest):
    """A tool call in an assistant message sent back with the conversation."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIRequest):
    role: Text
    # A string, or OpenAI's content parts ([{"type": "text", "text": ...}, ...]).
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    reasoning: Text | None = None  # an assistant's earlier reasoning (vLLM's name)
    reasoning_content: Text | None = None  # its older name


class FunctionDefinition(OpenAIRequest):
    name: NonEmptyText
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: NonEmptyText


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequestFields):
    messages: list[ChatMessage]
    # Deprecated by OpenAI in favour of max_completion_tokens.
    max_tokens: Annotated[WholeInt, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[WholeInt, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[WholeInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the reply starts with the message it continues
    chat_template: Text | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[Text, Any] | None = None

    _check_generation_prompt = model_validator(mode="before")(check_generation_prompt)


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    # OpenAI's fields jaxserve never fills, null as vLLM sends them (the SDK's message has
    # them: a client comparing it with the raw body finds the same keys).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None
    # vLLM's `reasoning`, and `reasoning_content`, its older name that clients still read.
    reasoning: str | None = None
    reasoning_content: str | None = None
    # None is sent as null: no calls where a call was forced but cut short (vLLM's).
    tool_calls: list[ToolCall] | None = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    # OpenAI's fields jaxserve has no value for, sent as null: service_tier and
    # system_fingerprint as vLLM sends them, metadata and moderation because the SDK's
    # ChatCompletion declares them too (a client comparing its object with the raw body, as
    # vLLM's own /invocations test does, finds the same keys).
    metadata: dict[str, str] | None = None
    moderation: dict[str, Any] | None = None
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: list[dict[int, LogprobInfo] | None] | None = None  # vLLM's
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaModel(OpenAIBaseModel):
    """A stream delta carries only what changed: fields left None are not sent."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(DeltaModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(DeltaModel):
    """OpenAI's streamed tool call: the first delta of a call carries its id, type and name;
    later ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(DeltaModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the new ones


class ChatCompletionStreamResponse(StreamResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    chat_usage: ClassVar[bool] = True
    prompt_token_ids: list[int] | None = None  # return_token_ids: the first chunk
