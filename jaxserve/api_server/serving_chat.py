"""POST /v1/chat/completions: the model's chat template, then generate, streamed or not."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import Response, StreamingResponse

from jaxserve.api_server.chat_output import ChatDelta, ChatOutputParser
from jaxserve.api_server.chat_tools import (
    ToolChoiceError,
    resolve_tool_mode,
    template_tools,
    tool_grammar,
)
from jaxserve.api_server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionTokensDetails,
    DeltaMessage,
    FunctionCall,
    ResponseMessage,
    ToolCall,
    UsageInfo,
    random_uuid,
)
from jaxserve.api_server.reasoning_parsers import REASONING_PARSERS
from jaxserve.api_server.serving import (
    OpenAIError,
    ServingContext,
    cached_prompt_tokens,
    clamp_logprob,
    logprob_token,
    prompt_logprobs_info,
    sse,
    sse_error,
    sse_finish_error,
    stop_holdback,
    text_content,
    visible_text_end,
)
from jaxserve.outputs import Logprob, RequestOutput


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def render_prompt(self, request: ChatCompletionRequest
                            ) -> tuple[str, list[int], list[tuple[str, float, float]]]:
        """The request's prompt: its text, its token ids and the time spans they took."""
        ctx = self.ctx
        t0 = time.time()
        text = await ctx.render_chat(request.messages, request.add_generation_prompt,
                                     request.continue_final_message, request.chat_template_kwargs,
                                     request.chat_template, template_tools(request))
        t1 = time.time()
        # The template already holds the special tokens (BOS etc.), as in vLLM.
        keep = request.truncate_prompt_tokens
        token_ids = await ctx.tokenize(text, "messages", truncating=keep is not None,
                                       add_special_tokens=False)
        asked = request.max_completion_tokens or request.max_tokens
        kept = ctx.truncate(token_ids, keep, request.truncation_side, room=asked or 1)
        if len(kept) < len(token_ids):
            text, token_ids = ctx.decode(kept), kept
        return text, token_ids, [("chat_template", t0, t1), ("tokenize", t1, time.time())]

    async def create_chat_completion(self, request: ChatCompletionRequest, *,
                                     fit_max_tokens: bool = False,
                                     prompt_details: bool = False) -> Response:
        """Validate, then generate; raises OpenAIError for a bad request. The Messages and
        Responses translations ask for `fit_max_tokens` (a max_tokens beyond the context left
        is served up to what is left, not refused) and `prompt_details` (the usage's cached
        prompt tokens, which plain chat reports under --enable-prompt-tokens-details)."""
        ctx = self.ctx
        received = time.time()
        ctx.check_model(request.model, generates=True)
        try:
            mode = resolve_tool_mode(request, ctx.tool_call_parser, ctx.enable_auto_tool_choice)
        except ToolChoiceError as e:
            raise OpenAIError(str(e), param=e.param) from None
        num_top = self._num_top_logprobs(request)
        text, token_ids, spans = await self.render_prompt(request)
        requested = request.max_completion_tokens
        requested = request.max_tokens if requested is None else requested
        if fit_max_tokens and requested is not None:
            requested = min(requested, max(ctx.max_model_len - len(token_ids), 1))
        max_tokens = ctx.check_prompt(token_ids, requested)
        details = prompt_details or ctx.enable_prompt_tokens_details
        structured = await ctx.structured_outputs(request)
        grammar = tool_grammar(request, mode)
        if grammar is not None:
            if structured is not None:
                raise OpenAIError(f'tool_choice "{mode.choice}" is enforced with a grammar: it '
                                  "cannot be combined with another structured output",
                                  param="tool_choice")
            structured = await ctx.check_grammar(*grammar, param="tools")
        if request.prompt_logprobs is not None and request.stream:
            raise OpenAIError("prompt_logprobs is not available when stream=true (vLLM's rule)",
                              param="prompt_logprobs")
        params = ctx.sampling_params(request, max_tokens, num_top, request.prompt_logprobs,
                                     structured_outputs=structured)
        # A grammar constrains the reply from its first token, so it has no reasoning part
        # (vLLM lets a model think before the grammar starts; not done here).
        reasoning = (REASONING_PARSERS[ctx.reasoning_parser]
                     if ctx.reasoning_parser and structured is None else None)
        if any(p is not None and p.needs_special_tokens for p in (reasoning, mode.parser)):
            # Their markers are special tokens: decoded away, the reply could not be split.
            params = dataclasses.replace(params, skip_special_tokens=False)
        echo = echoed_message(request)
        request_id = f"chatcmpl-{random_uuid()}"
        gen = ctx.client.generate(request_id, text, token_ids, params, priority=request.priority,
                                  trace=ctx.start_trace(request_id, received, spans))
        created = int(time.time())
        parsers = [ChatOutputParser(mode, reasoning) for _ in range(request.n)]
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, created, token_ids, gen,
                                                  parsers, details, echo),
                                     media_type="text/event-stream")
        final = None
        async with aclosing(gen) as results:
            async for res in results:
                final = res
        assert final is not None
        full = self._full_response(request, request_id, created, final, parsers, details, echo)
        if reasoning is not None and full.usage is not None:  # vLLM's, with a reasoning parser
            full.usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=await ctx.reasoning_tokens([c.message.reasoning for c in full.choices]))
        return Response(response_json(full, forced=mode.choice in ("required", "named")),
                        media_type="application/json")

    @staticmethod
    def _num_top_logprobs(request: ChatCompletionRequest) -> int | None:
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if request.return_tokens_as_token_ids and not request.logprobs:
            raise OpenAIError("return_tokens_as_token_ids names the tokens of logprobs: it "
                              "needs logprobs=true", param="return_tokens_as_token_ids")
        return (request.top_logprobs or 0) if request.logprobs else None

    def _full_response(self, request: ChatCompletionRequest, request_id: str, created: int,
                       res: RequestOutput, parsers: list[ChatOutputParser], details: bool,
                       echo: str = "") -> ChatCompletionResponse:
        """`echo`: the continued message's text, which each reply's content starts with."""
        choices = []
        for out in res.outputs:
            lps = None
            if request.logprobs and out.logprobs is not None:
                lps = chat_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0,
                                    bool(request.return_tokens_as_token_ids))
            parser = parsers[out.index]
            message = response_message(parser, out.text, reply_role(request),
                                       cut=out.finish_reason == "length")
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=message, logprobs=lps,
                finish_reason=parser.finish_reason(out.finish_reason), stop_reason=out.stop_reason,
                token_ids=list(out.token_ids) if request.return_token_ids else None))
        num_prompt = len(res.prompt_token_ids or [])
        num_generated = sum(len(o.token_ids) for o in res.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.ctx.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                            total_tokens=num_prompt + num_generated,
                            prompt_tokens_details=cached_prompt_tokens([res], details)),
            prompt_logprobs=prompt_logprobs_info(request.prompt_logprobs, res),
            prompt_token_ids=list(res.prompt_token_ids or []) if request.return_token_ids else None)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      prompt_token_ids: list[int], gen: AsyncGenerator[RequestOutput, None],
                      parsers: list[ChatOutputParser], details: bool, echo: str = ""
                      ) -> AsyncIterator[str]:
        n, model = request.n, self.ctx.model_name
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.usage_on_every_chunk)
        exclude = None if include_usage else {"usage"}
        sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n
        last: RequestOutput | None = None
        # With a reasoning parser, usage counts the reasoning's tokens (vLLM's): recounted
        # for each usage sent, on every chunk only with continuous usage.
        counts_reasoning = parsers[0].reasoning is not None
        thought = 0

        async def count_reasoning() -> None:
            nonlocal thought
            thought = await self.ctx.reasoning_tokens([p.reasoning_text for p in parsers])

        def usage() -> UsageInfo:
            num_prompt, num_generated = len(prompt_token_ids), sum(sent_tokens)
            return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                             total_tokens=num_prompt + num_generated,
                             prompt_tokens_details=cached_prompt_tokens([last], details),
                             completion_tokens_details=CompletionTokensDetails(
                                 reasoning_tokens=thought) if counts_reasoning else None)

        def chunk(choices: list[ChatCompletionResponseStreamChoice],
                  prompt_ids: list[int] | None = None) -> str:
            return sse(stream_chunk_json(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices,
                prompt_token_ids=prompt_ids, usage=usage() if continuous else None,
            ), exclude))

        errors: list[str] = []  # error events of choices that ended with an error
        holdback = stop_holdback(request)
        try:
            # OpenAI's first chunk of each choice carries the role only. One choice a chunk,
            # as vLLM sends them: clients read choices[0].
            role = reply_role(request)
            for k in range(n):
                yield chunk([ChatCompletionResponseStreamChoice(
                    index=k, delta=DeltaMessage(role=role, content=""))],
                    prompt_token_ids if request.return_token_ids and k == 0 else None)
            if echo:  # vLLM's: the continued message, before what continues it
                for k in range(n):
                    yield chunk([ChatCompletionResponseStreamChoice(
                        index=k, delta=DeltaMessage(content=echo))])
            async with aclosing(gen) as results:
                async for res in results:
                    last, choices = res, []
                    for out in res.outputs:
                        k = out.index
                        if done[k]:
                            continue
                        finished = out.finish_reason is not None
                        end = visible_text_end(out.text, sent_chars[k], finished, holdback)
                        delta = parsers[k].delta(out.text[:end], finished)
                        new_tokens = out.token_ids[sent_tokens[k]:]
                        # Tokens that add no visible text (held back, or a tool call's
                        # unsettled start) are sent only when their logprobs or ids are asked for.
                        if not (delta.content or delta.reasoning or delta.tool_calls or finished
                                or ((request.logprobs or request.return_token_ids) and new_tokens)):
                            continue
                        lps = None
                        if request.logprobs and out.logprobs is not None:
                            lps = chat_logprobs(new_tokens, out.logprobs[sent_tokens[k]:len(out.token_ids)],
                                                request.top_logprobs or 0,
                                                bool(request.return_tokens_as_token_ids))
                        sent_chars[k], sent_tokens[k], done[k] = end, len(out.token_ids), finished
                        choices.append(ChatCompletionResponseStreamChoice(
                            index=k, delta=delta_message(delta), logprobs=lps,
                            finish_reason=parsers[k].finish_reason(out.finish_reason),
                            stop_reason=out.stop_reason,
                            token_ids=list(new_tokens) if request.return_token_ids else None))
                        if finished and (event := sse_finish_error(out)) is not None:
                            errors.append(event)
                    if continuous and counts_reasoning and any(c.delta.reasoning for c in choices):
                        await count_reasoning()
                    for choice in choices:
                        yield chunk([choice])
                    while errors:
                        yield errors.pop(0)
            if include_usage:
                if counts_reasoning:
                    await count_reasoning()
                yield sse(stream_chunk_json(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=usage()), None))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse_error(e, request_id)
        yield "data: [DONE]\n\n"


def response_message(parser: ChatOutputParser, text: str, role: str = "assistant",
                     cut: bool = False) -> ResponseMessage:
    """A whole reply as OpenAI's message: content (None when only tools were called),
    reasoning, tool calls. `cut`: max_tokens ended it; a call that tool_choice forced
    ("required" or a named function) is then left out unless its JSON is whole, as vLLM
    answers (content "", no tool_calls), rather than returned with half its arguments."""
    d = parser.delta(text, finished=True)
    calls = [ToolCall(id=c.id or "", function=FunctionCall(name=c.function.name or "",
                                                           arguments=c.function.arguments or ""))
             for c in d.tool_calls if c.function is not None]
    forced = parser.mode.choice in ("required", "named")
    if forced and cut and not whole_json(text):
        calls = []
    reasoning = d.reasoning if parser.has_reasoning else None
    content = d.content if not calls else d.content or None
    return ResponseMessage(role=role, content=content, reasoning=reasoning,
                           reasoning_content=reasoning, tool_calls=calls)


def whole_json(text: str) -> bool:
    """Whether `text` is one complete JSON value (a forced call's reply that max_tokens did
    not cut short)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def reply_role(request: ChatCompletionRequest) -> str:
    """The role the reply is written in (vLLM's get_chat_request_role): the assistant's, or
    without a generation prompt the last message's (the one continued)."""
    return "assistant" if request.add_generation_prompt else request.messages[-1].role


def echoed_message(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message's text when that message
    is in the reply's role (continue_final_message's prefill, say); "" otherwise."""
    if not request.echo:
        return ""
    last = request.messages[-1]
    return text_content(last.content) if last.role == reply_role(request) else ""


def response_json(response: ChatCompletionResponse, forced: bool = False) -> str:
    """The response's JSON. `forced`: tool_choice forced a call ("required" or a named
    function); a message that made none (max_tokens cut it) has then no `tool_calls` key,
    which clients read as None, as vLLM answers it (its ChatMessage drops an empty list)."""
    bare = {i: {"message": {"tool_calls"}} for i, c in enumerate(response.choices)
            if forced and not c.message.tool_calls}
    return response.model_dump_json(exclude={"choices": bare} if bare else None)


def stream_chunk_json(chunk: ChatCompletionStreamResponse, exclude: set[str] | None) -> str:
    """A stream chunk's JSON, without the return_token_ids fields it does not carry: the
    prompt's ids only in the first chunk, a choice's ids only where it has new tokens (a
    client that finds the key extends its list with the value; vLLM leaves them unset)."""
    drop: dict[str, Any] = dict.fromkeys(exclude or (), True)
    if chunk.prompt_token_ids is None:
        drop["prompt_token_ids"] = True
    no_ids = {i: {"token_ids"} for i, c in enumerate(chunk.choices) if c.token_ids is None}
    if no_ids:
        drop["choices"] = no_ids
    return chunk.model_dump_json(exclude=drop)


def delta_message(d: ChatDelta) -> DeltaMessage:
    return DeltaMessage(content=d.content if d.content or not (d.reasoning or d.tool_calls) else None,
                        reasoning=d.reasoning or None, reasoning_content=d.reasoning or None,
                        tool_calls=d.tool_calls or None)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int, as_ids: bool = False) -> ChatCompletionLogProbs:
    """Per token: its text (`as_ids`: "token_id:N"), logprob and UTF-8 bytes, and the
    `num_top` most likely tokens."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda p: p[1].rank or 0)  # every rank here is set
        token = logprob_token(tid, entry[tid], as_ids)
        content.append(ChatCompletionLogProbsContent(
            token=token, logprob=clamp_logprob(entry[tid].logprob), bytes=list(token.encode()),
            top_logprobs=[ChatCompletionLogProb(token=(name := logprob_token(t, lp, as_ids)),
                                                logprob=clamp_logprob(lp.logprob),
                                                bytes=list(name.encode()))
                          for t, lp in top]))
    return ChatCompletionLogProbs(content=content)
