"""What the OpenAI endpoints share (vLLM's `OpenAIServing`): model check,
prompt-length and sampling validation, errors, and the SSE plumbing.

Error taxonomy: `OpenAIError` is the request's own fault (4xx, its field named); an
engine that is gone is 503; anything else is a bug: 500 with a generic message and an
error id, logged once with the id (traceback at debug level).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi.responses import JSONResponse

from jaxserve.api_server.chat_tools import template_message
from jaxserve.api_server.protocol import (
    ChatMessage,
    ErrorInfo,
    ErrorResponse,
    LogprobInfo,
    PromptTokensDetails,
    SamplingRequestFields,
)
from jaxserve.api_server.symptoms import ServerFacts
from jaxserve.engine.core_client import EngineDeadError, RequestRejectedError
from jaxserve.engine.processor import InvalidInputError, Processor
from jaxserve.engine.protocol import EngineClient
from jaxserve.metrics.prometheus import ServerMetrics
from jaxserve.metrics.trace_store import TraceStore
from jaxserve.outputs import RequestOutput
from jaxserve.request_trace import RequestTrace
from jaxserve.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger("jaxserve.api_server")


class OpenAIError(Exception):
    """The request's own fault, sent as OpenAI's body {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, status.phrase),
                                         param=param, code=int(status)))


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param).model_dump(), status_code=int(status))


def error_from_exception(e: BaseException, where: str = "request") -> OpenAIError:
    """Map what handling a request can raise to an OpenAIError. Only OpenAIError and the
    engine's refusal of a request are the request's fault; a bug is logged here, once."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, InvalidInputError):
        return OpenAIError(str(e), HTTPStatus.BAD_REQUEST, e.param)
    if isinstance(e, RequestRejectedError):
        return OpenAIError(str(e), HTTPStatus.BAD_REQUEST)
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s failed with an internal error (error id %s): %s", where, error_id,
                 type(e).__name__)
    logger.debug("error id %s", error_id, exc_info=e)
    return OpenAIError(f"internal server error (error id {error_id})",
                       HTTPStatus.INTERNAL_SERVER_ERROR)


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_finish_error(out: Any) -> str | None:
    """The in-band error event after a choice the engine ended with finish_reason "error" (its
    grammar could not go on: `stop_reason` says why), or None for any other choice."""
    if out.finish_reason != "error":
        return None
    return sse(error_body(str(out.stop_reason or "generation failed"),
                          HTTPStatus.BAD_REQUEST).model_dump_json())


def sse_error(e: BaseException, where: str) -> str:
    err = error_from_exception(e, where)
    return sse(error_body(err.message, err.status, err.param).model_dump_json())


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest token: a text longer than this times N tokens
    has more than N tokens, so it can be refused without tokenizing it."""
    vocab = tokenizer.get_vocab()
    # Byte-level BPE spells each byte as one character, so this bounds the decoded length.
    return max(max((len(t) for t in vocab), default=1), 1)


@dataclass
class ServingContext:
    """Everything the endpoints need to know about the served model."""

    client: EngineClient
    tokenizer: Any  # None: --skip-tokenizer-init (token-id prompts only, no text out)
    served_model_names: list[str]
    # The request checks shared with the offline LLM (FrontEnd.processor,
    # jaxserve/engine/front_end.py): limits, the model's EOS ids, --max-logprobs.
    processor: Processor
    trust_request_chat_template: bool = False
    # Sampling defaults from the model's generation_config.json (--generation-config).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser
    enable_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    responses_store_size: int = 256  # --responses-store-size
    # /debug: request traces, the metrics behind its live counters, the flags diagnose's
    # advice names.
    traces: TraceStore = field(default_factory=lambda: TraceStore(enabled=False))
    metrics: ServerMetrics = field(default_factory=lambda: ServerMetrics("unnamed"))
    facts: ServerFacts = field(default_factory=lambda: ServerFacts(0, 0))
    # Tokenizing and rendering templates run here, off the event loop: a large request must
    # not stall /health or other clients' streams.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="jaxserve-tokenize"))
    max_token_chars: int = 0  # longest_token_chars(tokenizer), computed when 0

    def __post_init__(self) -> None:
        if not self.max_token_chars:
            self.max_token_chars = (1 if self.tokenizer is None
                                    else longest_token_chars(self.tokenizer))

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_prompt_chars(self) -> int:
        return self.max_token_chars * self.max_model_len

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: fn(*args, **kwargs))

    def check_text_size(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit max_model_len."""
        if len(text) > self.max_prompt_chars:
            raise OpenAIError(
                f"{param} has {len(text):,} characters: more than max_model_len "
                f"({self.max_model_len}) tokens can hold", param=param)

    def need_tokenizer(self, param: str) -> None:
        """Refuse, naming `param`, what needs text when the server has no tokenizer."""
        if self.tokenizer is None:
            raise OpenAIError(f"{param} needs the model's tokenizer, and the server was started "
                              "with --skip-tokenizer-init: send token ids", param=param)

    async def tokenize(self, text: str, param: str = "prompt", truncating: bool = False,
                       **kwargs: Any) -> list[int]:
        """`text`'s token ids. Unless it will be truncated, a text too long for max_model_len
        is refused before it is tokenized (the body's size limit bounds the rest)."""
        self.need_tokenizer(param)
        if not truncating:
            self.check_text_size(text, param)
        return (await self.off_loop(self.tokenizer, text, **kwargs)).input_ids

    async def reasoning_tokens(self, reasonings: list[str | None]) -> int:
        """The usage's `reasoning_tokens`: the tokens of the replies' reasoning texts (what a
        reasoning parser split off, its markers left out), tokenized again."""
        texts = [r for r in reasonings if r]
        if not texts or self.tokenizer is None:
            return 0
        ids = [await self.tokenize(t, "reasoning", truncating=True, add_special_tokens=False)
               for t in texts]
        return sum(len(i) for i in ids)

    def truncate(self, token_ids: list[int], keep: int | None, side: str | None,
                 room: int = 1) -> list[int]:
        """vLLM's truncate_prompt_tokens: `keep` of the prompt's tokens, the last ones unless
        `side` is "right"; -1 keeps as many as leave `room` (the tokens asked for) in
        max_model_len."""
        if keep is None:
            return token_ids
        limit = self.max_model_len
        if keep > limit:
            raise OpenAIError(f"truncate_prompt_tokens value ({keep}) is greater than "
                              f"max_model_len ({limit}). Please request a smaller truncation "
                              "size.", param="truncate_prompt_tokens")  # vLLM's words
        keep = max(limit - room, 1) if keep == -1 else keep
        if keep >= len(token_ids):
            return token_ids
        return token_ids[:keep] if side == "right" else token_ids[len(token_ids) - keep:]

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids`; "" without a tokenizer (vLLM's skip_tokenizer_init)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def start_trace(self, request_id: str, received: float,
                    spans: list[tuple[str, float, float]]) -> RequestTrace | None:
        """The request's trace, with the API server's work so far (None: tracing is off)."""
        trace = self.traces.new(request_id, received)
        if trace is not None:
            for name, start, end in spans:
                trace.add("api_server", name, start, end)
        return trace

    def check_model(self, model: str | None, generates: bool = False) -> None:
        """A missing or empty `model` is the served one, as in vLLM; an endpoint that
        `generates` refuses a classifier."""
        if model and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")
        try:
            if generates:
                self.processor.check_generates()
        except InvalidInputError as e:
            raise OpenAIError(str(e)) from None

    def check_prompt(self, token_ids: list[int], max_tokens: int | None) -> int:
        """Validate the prompt's length against max_model_len; returns max_tokens
        (None: as many as fit, as vLLM does for chat)."""
        try:
            return self.processor.check_prompt(token_ids, max_tokens)
        except InvalidInputError as e:
            raise OpenAIError(str(e), param=e.param) from None

    async def structured_outputs(self, request: SamplingRequestFields) -> tuple[str, str] | None:
        """(kind, spec) from response_format / structured_outputs / guided_*, checked by
        compiling the grammar off the event loop (a bad schema is a 400, not an engine error)."""
        found: list[tuple[str, str, Any]] = []  # (param, kind, spec)
        rf = request.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", "json_object", ""))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise OpenAIError("response_format json_schema needs json_schema.schema",
                                  param="response_format")
            found.append(("response_format", "json", rf.json_schema.schema_))
        so = request.structured_outputs
        if so is not None:
            for name, kind in (("json_", "json"), ("regex", "regex"), ("choice", "choice"),
                               ("grammar", "grammar")):
                if getattr(so, name) is not None:
                    found.append(("structured_outputs", kind, getattr(so, name)))
            if so.json_object:
                found.append(("structured_outputs", "json_object", ""))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(request, name) is not None:
                found.append((name, kind, getattr(request, name)))
        if not found:
            return None
        if len(found) > 1:
            raise OpenAIError("give one structured output constraint, got "
                              + ", ".join(f"{p} ({k})" for p, k, _ in found), param=found[1][0])
        param, kind, spec = found[0]
        if not isinstance(spec, str):
            spec = json.dumps(spec)  # a schema or a choice list, as llguidance reads it
        return await self.check_grammar(kind, spec, param)

    async def check_grammar(self, kind: str, spec: str, param: str) -> tuple[str, str]:
        """(kind, spec) once its grammar compiles (off the event loop); a 400 naming `param`
        if it does not."""
        self.need_tokenizer(param)  # a grammar is matched against the tokens' texts
        try:
            return await self.off_loop(self.processor.check_grammar, kind, spec, param)
        except InvalidInputError as e:
            raise OpenAIError(str(e), param=e.param) from None

    def sampling_params(self, request: SamplingRequestFields, max_tokens: int,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_outputs: tuple[str, str] | None = None) -> SamplingParams:
        """SamplingParams from the request's fields; a bad value is a 400 naming the field."""
        if request.stop:
            self.need_tokenizer("stop")  # stop strings are matched in the detokenized text
        logit_bias = {}
        for key, value in (request.logit_bias or {}).items():
            # OpenAI's JSON keys are token ids as strings.
            if not key.isdigit():
                raise OpenAIError(f"logit_bias keys must be token ids in [0, {self.vocab_size}), "
                                  f"got {key!r}", param="logit_bias")
            logit_bias[int(key)] = value
        kwargs: dict[str, Any] = dict(
            n=request.n, max_tokens=max_tokens, logprobs=logprobs, seed=request.seed,
            stop=request.stop, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output, logit_bias=logit_bias,
            prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs,
            allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words,
        )
        optional = dict(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                        min_p=request.min_p, repetition_penalty=request.repetition_penalty,
                        presence_penalty=request.presence_penalty,
                        frequency_penalty=request.frequency_penalty)
        kwargs.update(self.default_sampling)  # the model's defaults, then the request's own
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        try:
            return self.processor.make_params(**kwargs)
        except InvalidInputError as e:
            raise OpenAIError(str(e), param=e.param) from None

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool = False,
                          chat_template_kwargs: dict[str, Any] | None = None,
                          chat_template: str | None = None,
                          tools: list[dict[str, Any]] | None = None) -> str:
        """The model's chat template applied to `messages` (text content parts joined) and
        `tools`, rendered off the event loop. A template sent with the request is refused
        unless the server trusts them (vLLM's --trust-request-chat-template): its cost is
        unbounded."""
        self.need_tokenizer("messages")
        conversation = [template_message(m, text_content(m.content)) for m in messages]
        if not conversation:
            raise OpenAIError("messages must not be empty", param="messages")
        self.check_text_size("".join(c["content"] for c in conversation), "messages")
        kwargs = dict(chat_template_kwargs or {})
        if "chat_template" in kwargs:
            chat_template = kwargs.pop("chat_template")
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError("a chat template in the request is refused: the server was not "
                              "started with --trust-request-chat-template", param="chat_template")
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, **kwargs)
            except Exception as e:  # a template error is the conversation's fault
                raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None

        text = await self.off_loop(render)
        self.check_text_size(text, "messages")
        return text


def text_content(content: str | list[Any] | None) -> str:
    """A message's content as the chat template reads it: its text parts joined by lines."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(f"content parts must be {{'type': 'text', 'text': ...}} (text only), "
                              f"got type {part.type!r}", param="messages")
        parts.append(part.text)
    return "\n".join(parts)


def stop_holdback(request: SamplingRequestFields) -> int:
    """Characters a stream must hold back while a stop string may be forming
    (vLLM's stop_buffer_length): text that turns out to start a stop string
    must never have been sent."""
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if not stop or request.include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


def visible_text_end(text: str, sent: int, finished: bool, holdback: int) -> int:
    """How far into `text` a stream may send now."""
    return len(text) if finished else max(len(text) - holdback, sent)


def cached_prompt_tokens(results: Iterable[RequestOutput | None], wanted: bool
                         ) -> PromptTokensDetails | None:
    """The usage's prompt_tokens_details (the prompt tokens the prefix cache served, over
    `results`), when wanted (--enable-prompt-tokens-details, or the translated APIs)."""
    if not wanted:
        return None
    return PromptTokensDetails(cached_tokens=sum(r.num_cached_tokens or 0
                                                 for r in results if r is not None))


def logprob_token(token_id: int, lp: Any, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token or ""


def clamp_logprob(v: float) -> float:
    """JSON has no -inf; vLLM reports -9999.0 instead."""
    return max(v, -9999.0)


def prompt_logprobs_info(asked: int | None, res: RequestOutput
                         ) -> list[dict[int, LogprobInfo] | None] | None:
    """vLLM's prompt_logprobs of a response: per prompt token (None for the first), its
    logprob and the top-`asked` tokens."""
    if asked is None or res.prompt_logprobs is None:
        return None
    return [None if e is None else {t: LogprobInfo(logprob=clamp_logprob(lp.logprob),
                                                   rank=lp.rank, decoded_token=lp.decoded_token)
                                    for t, lp in e.items()} for e in res.prompt_logprobs]


async def merge_async_iterators(*iterators: AsyncGenerator[T, None]
                                ) -> AsyncGenerator[tuple[int, T], None]:
    """Yield (index, item) from several async generators as items arrive.
    Closing this generator closes (so aborts) every one of them."""
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as it:
            async for item in it:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | BaseException] | None] = asyncio.Queue()

    async def drain(i: int, it: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(it):
                async for item in it:
                    await queue.put((i, item))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))
        await queue.put(None)

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            i, value = entry
            if isinstance(value, BaseException):
                raise value
            yield i, value
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
