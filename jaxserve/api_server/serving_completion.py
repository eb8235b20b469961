"""POST /v1/completions: one or more prompts (text or token ids), streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import Response, StreamingResponse

from jaxserve.api_server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_uuid,
)
from jaxserve.api_server.serving import (
    OpenAIError,
    ServingContext,
    cached_prompt_tokens,
    clamp_logprob,
    logprob_token,
    merge_async_iterators,
    prompt_logprobs_info,
    sse,
    sse_error,
    sse_finish_error,
    stop_holdback,
    visible_text_end,
)
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput

# A request fans out into prompts x n engine sequences; bound it (one request must not be
# able to fill the engine's queues for everyone).
MAX_PROMPTS = 128
MAX_SEQUENCES = 256


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_completion(self, request: CompletionRequest) -> Response:
        """Validate, then generate; raises OpenAIError for a bad request."""
        ctx = self.ctx
        received = time.time()
        ctx.check_model(request.model, generates=True)
        if request.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if request.return_tokens_as_token_ids and request.logprobs is None:
            raise OpenAIError("return_tokens_as_token_ids names the tokens of logprobs: it "
                              "needs logprobs", param="return_tokens_as_token_ids")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (it must equal n)", param="best_of")
        # vLLM's echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated;
        # the engine samples one token, which the response leaves out.
        echo_only = request.max_tokens == 0
        if echo_only and not request.echo:
            raise OpenAIError("max_tokens must be at least 1, got 0 (0 only with echo: the "
                              "prompt back with its logprobs)", param="max_tokens")
        prompts = await self._prompts(request)
        spans = [("tokenize", received, time.time())]
        if len(prompts) * request.n > MAX_SEQUENCES:
            raise OpenAIError(f"{len(prompts)} prompts x n={request.n} exceeds {MAX_SEQUENCES} "
                              "sequences per request", param="n")
        gens: list[AsyncGenerator[RequestOutput, None]] = []
        arrival = time.monotonic()
        request_id = f"cmpl-{random_uuid()}"
        params_list = []
        structured = await ctx.structured_outputs(request)
        for _, ids in prompts:
            max_tokens = ctx.check_prompt(ids, 1 if echo_only else request.max_tokens)
            # echo + logprobs reports the prompt's tokens too: it needs their logprobs.
            prompt_lps = request.prompt_logprobs
            if request.echo and request.logprobs is not None:
                prompt_lps = max(prompt_lps or 0, request.logprobs)
            params_list.append(ctx.sampling_params(request, max_tokens, request.logprobs,
                                                   prompt_lps, structured))
        for i, ((text, ids), params) in enumerate(zip(prompts, params_list)):
            rid = f"{request_id}-{i}"
            gens.append(ctx.client.generate(rid, text, ids, params, priority=request.priority,
                                            arrival_time=arrival,
                                            trace=ctx.start_trace(rid, received, spans)))
        created = int(time.time())
        if request.stream and not echo_only:
            return StreamingResponse(self._stream(request, request_id, created, prompts, gens),
                                     media_type="text/event-stream")
        final: list[RequestOutput | None] = [None] * len(prompts)
        async with aclosing(merge_async_iterators(*gens)) as results:
            async for i, res in results:
                final[i] = res
        full = self._full_response(request, request_id, created, prompts, final)
        if request.stream:  # echo only: nothing to stream but the whole answer
            return StreamingResponse(self._stream_whole(request, full), media_type="text/event-stream")
        return Response(full.model_dump_json(), media_type="application/json")

    @staticmethod
    async def _stream_whole(request: CompletionRequest, full: CompletionResponse) -> AsyncIterator[str]:
        """A finished response as a stream: a chunk per choice, then usage if asked, [DONE]."""
        for choice in full.choices:
            yield sse(CompletionStreamResponse(id=full.id, created=full.created, model=full.model,
                                               choices=[choice]).model_dump_json(exclude={"usage"}))
        if request.stream_options and request.stream_options.include_usage:
            yield sse(CompletionStreamResponse(id=full.id, created=full.created, model=full.model,
                                               choices=[], usage=full.usage).model_dump_json())
        yield "data: [DONE]\n\n"

    async def _prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt, truncated as asked; texts tokenized off
        the event loop. A truncated text prompt is its kept tokens (text None)."""
        keep, side = request.truncate_prompt_tokens, request.truncation_side
        out = []
        for text, ids in await self._tokenized(request.prompt, keep is not None):
            kept = self.ctx.truncate(ids, keep, side, room=request.max_tokens or 1)
            out.append((text, ids) if len(kept) == len(ids) else (None, kept))
        return out

    async def _tokenized(self, prompt: Any, truncating: bool
                         ) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if len(prompt) > MAX_PROMPTS:
            raise OpenAIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
                              param="prompt")
        out: list[tuple[str | None, list[int]]] = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, await self.ctx.tokenize(p, truncating=truncating)))
            else:
                out.append((None, list(p)))
        return out

    def _prompt_text(self, prompts: list[tuple[str | None, list[int]]], i: int) -> str:
        text, ids = prompts[i]
        return text if text is not None else self.ctx.decode(ids)

    def _full_response(self, request: CompletionRequest, request_id: str, created: int,
                       prompts: list[tuple[str | None, list[int]]],
                       final: list[RequestOutput | None]) -> CompletionResponse:
        choices, num_generated = [], 0
        for i, res in enumerate(final):
            assert res is not None
            for out in res.outputs:
                token_ids, logprobs, text = out.token_ids, out.logprobs, out.text
                if request.max_tokens == 0:  # echo only: the sampled token is left out
                    token_ids, logprobs, text = [], [], ""
                if request.echo:
                    text = self._prompt_text(prompts, i) + text
                lps = None
                if request.logprobs is not None and logprobs is not None:
                    lps = self._logprobs(request, prompts, i, res, token_ids, logprobs, 0)
                choices.append(CompletionResponseChoice(
                    index=i * request.n + out.index, text=text, logprobs=lps,
                    prompt_logprobs=prompt_logprobs_info(request.prompt_logprobs, res),
                    finish_reason="length" if request.max_tokens == 0 else out.finish_reason,
                    stop_reason=None if request.max_tokens == 0 else out.stop_reason,
                    **self._token_ids(request, prompts, i, token_ids, True)))
                num_generated += len(token_ids)
        num_prompt = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(
            id=request_id, created=created, model=self.ctx.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                            total_tokens=num_prompt + num_generated,
                            prompt_tokens_details=cached_prompt_tokens(
                                final, self.ctx.enable_prompt_tokens_details)))

    async def _stream(self, request: CompletionRequest, request_id: str, created: int,
                      prompts: list[tuple[str | None, list[int]]],
                      gens: list[AsyncGenerator[RequestOutput, None]]) -> AsyncIterator[str]:
        n, model = request.n, self.ctx.model_name
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.usage_on_every_chunk)
        exclude = None if include_usage else {"usage"}
        # Per choice: characters and tokens already sent, finished or not.
        sent_chars = [[0] * n for _ in prompts]
        sent_tokens = [[0] * n for _ in prompts]
        done = [[False] * n for _ in prompts]
        num_prompt = sum(len(ids) for _, ids in prompts)

        latest: list[RequestOutput | None] = [None] * len(prompts)

        def usage() -> UsageInfo:
            num_generated = sum(map(sum, sent_tokens))
            return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                             total_tokens=num_prompt + num_generated,
                             prompt_tokens_details=cached_prompt_tokens(
                                 latest, self.ctx.enable_prompt_tokens_details))
        holdback = stop_holdback(request)
        try:
            async with aclosing(merge_async_iterators(*gens)) as results:
                async for i, res in results:
                    latest[i] = res
                    choices = []
                    errors = []  # error events of choices that ended with an error
                    for out in res.outputs:
                        choice = self._delta(request, prompts, i, res, out, sent_chars[i],
                                             sent_tokens[i], done[i], holdback)
                        if choice is not None:
                            choices.append(choice)
                            if choice.finish_reason and (event := sse_finish_error(out)):
                                errors.append(event)
                    for choice in choices:  # one a chunk, as vLLM sends them: clients read choices[0]
                        chunk = CompletionStreamResponse(id=request_id, created=created,
                                                         model=model, choices=[choice],
                                                         usage=usage() if continuous else None)
                        yield sse(chunk.model_dump_json(exclude=exclude))
                    for event in errors:
                        yield event
            if include_usage:
                chunk = CompletionStreamResponse(id=request_id, created=created, model=model,
                                                 choices=[], usage=usage())
                yield sse(chunk.model_dump_json())
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse_error(e, request_id)
        yield "data: [DONE]\n\n"

    def _delta(self, request: CompletionRequest, prompts: list[tuple[str | None, list[int]]],
               i: int, res: RequestOutput, out: CompletionOutput, sent_chars: list[int],
               sent_tokens: list[int], done: list[bool], holdback: int
               ) -> CompletionResponseChoice | None:
        """What choice `out` adds since the previous chunk, or None if nothing."""
        k = out.index
        if done[k]:
            return None
        finished = out.finish_reason is not None
        end = visible_text_end(out.text, sent_chars[k], finished, holdback)
        text = out.text[sent_chars[k]:end]
        new_tokens = out.token_ids[sent_tokens[k]:]
        first = sent_chars[k] == 0 and sent_tokens[k] == 0
        if request.echo and first:
            text = self._prompt_text(prompts, i) + text
        if not text and not new_tokens and not finished:
            return None
        lps = None
        if request.logprobs is not None and out.logprobs is not None:
            new_lps = out.logprobs[sent_tokens[k]:len(out.token_ids)]
            if first:
                lps = self._logprobs(request, prompts, i, res, new_tokens, new_lps, 0)
            else:  # offsets count the echoed prompt too
                echoed = len(self._prompt_text(prompts, i)) if request.echo else 0
                lps = completion_logprobs(new_tokens, new_lps, sent_chars[k] + echoed,
                                          bool(request.return_tokens_as_token_ids))
        sent_chars[k] = end
        sent_tokens[k] = len(out.token_ids)
        done[k] = finished
        return CompletionResponseChoice(index=i * request.n + k, text=text, logprobs=lps,
                                        prompt_logprobs=prompt_logprobs_info(request.prompt_logprobs, res)
                                        if first else None,
                                        finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                                        **self._token_ids(request, prompts, i, new_tokens, first))

    @staticmethod
    def _token_ids(request: CompletionRequest, prompts: list[tuple[str | None, list[int]]],
                   i: int, token_ids: list[int], first: bool) -> dict[str, list[int] | None]:
        """vLLM's return_token_ids: the output's ids (a stream: the new ones), and the
        prompt's in the first chunk."""
        if not request.return_token_ids:
            return {}
        return dict(token_ids=list(token_ids), prompt_token_ids=list(prompts[i][1]) if first else None)

    def _logprobs(self, request: CompletionRequest, prompts: list[tuple[str | None, list[int]]],
                  i: int, res: RequestOutput, token_ids: list[int],
                  logprobs: list[dict[int, Logprob]], text_offset: int) -> CompletionLogProbs:
        """The output tokens' logprobs; with echo, the prompt's first (OpenAI's echo +
        logprobs: the first prompt token has none)."""
        as_ids = bool(request.return_tokens_as_token_ids)
        if not request.echo:
            return completion_logprobs(token_ids, logprobs, text_offset, as_ids)
        ids = prompts[i][1]
        plps = res.prompt_logprobs or [None] * len(ids)
        result = CompletionLogProbs()
        for tid, entry in zip(ids, plps):
            if as_ids:
                token = f"token_id:{tid}"
            elif entry is not None and tid in entry:
                # Named after the prompt tokens before it (a character split over tokens).
                token = entry[tid].decoded_token or ""
            else:
                token = self.ctx.decode([tid])
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(clamp_logprob(entry[tid].logprob))
                top = sorted(entry.items(), key=lambda p: p[1].rank or 0)
                result.top_logprobs.append({logprob_token(t, lp, as_ids): clamp_logprob(lp.logprob)
                                            for t, lp in top[: 1 + (request.logprobs or 0)]})
            text_offset += len(token)
        rest = completion_logprobs(token_ids, logprobs, text_offset, as_ids)
        for name in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
            getattr(result, name).extend(getattr(rest, name))
        return result


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        text_offset: int, as_ids: bool = False) -> CompletionLogProbs:
    """OpenAI's legacy logprobs: per token its text, offset, logprob and top candidates
    (the sampled token included, as vLLM does)."""
    result = CompletionLogProbs()
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry[tid]
        token = logprob_token(tid, sampled, as_ids)
        result.tokens.append(token)
        result.token_logprobs.append(clamp_logprob(sampled.logprob))
        result.text_offset.append(text_offset)
        result.top_logprobs.append(
            {logprob_token(t, lp, as_ids): clamp_logprob(lp.logprob) for t, lp in entry.items()})
        text_offset += len(token)
    return result
