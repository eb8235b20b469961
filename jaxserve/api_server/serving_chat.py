"""POST /v1/chat/completions: the model's chat template, then generate, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from fastapi.responses import Response, StreamingResponse

from jaxserve.api_server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    ResponseMessage,
    UsageInfo,
    random_uuid,
)
from jaxserve.api_server.serving import (
    OpenAIError,
    ServingContext,
    clamp_logprob,
    sse,
    sse_error,
    stop_holdback,
    visible_text_end,
)
from jaxserve.outputs import Logprob, RequestOutput


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        """Validate, then generate; raises OpenAIError for a bad request."""
        ctx = self.ctx
        ctx.check_model(request.model)
        if request.tools and request.tool_choice != "none":
            raise OpenAIError("tools are not supported", param="tools")
        num_top = self._num_top_logprobs(request)
        text = await ctx.render_chat(request.messages, request.add_generation_prompt,
                                     request.continue_final_message, request.chat_template_kwargs,
                                     request.chat_template)
        # The template already holds the special tokens (BOS etc.), as in vLLM.
        token_ids = await ctx.tokenize(text, "messages", add_special_tokens=False)
        requested = request.max_completion_tokens
        max_tokens = ctx.check_prompt(token_ids, request.max_tokens if requested is None else requested)
        params = ctx.sampling_params(request, max_tokens, num_top,
                                     structured_outputs=await ctx.structured_outputs(request))
        request_id = f"chatcmpl-{random_uuid()}"
        gen = ctx.client.generate(request_id, text, token_ids, params, priority=request.priority)
        created = int(time.time())
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, created, token_ids, gen),
                                     media_type="text/event-stream")
        final = None
        async with aclosing(gen) as results:
            async for res in results:
                final = res
        assert final is not None
        return Response(self._full_response(request, request_id, created, final).model_dump_json(),
                        media_type="application/json")

    @staticmethod
    def _num_top_logprobs(request: ChatCompletionRequest) -> int | None:
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None

    def _full_response(self, request: ChatCompletionRequest, request_id: str, created: int,
                       res: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for out in res.outputs:
            lps = None
            if request.logprobs and out.logprobs is not None:
                lps = chat_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0)
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=ResponseMessage(content=out.text), logprobs=lps,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        num_prompt = len(res.prompt_token_ids or [])
        num_generated = sum(len(o.token_ids) for o in res.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.ctx.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                            total_tokens=num_prompt + num_generated))

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      prompt_token_ids: list[int], gen: AsyncGenerator[RequestOutput, None]
                      ) -> AsyncIterator[str]:
        n, model = request.n, self.ctx.model_name
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        exclude = None if include_usage else {"usage"}

        def chunk(choices: list[ChatCompletionResponseStreamChoice]) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices,
            ).model_dump_json(exclude=exclude))

        sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n
        holdback = stop_holdback(request)
        try:
            # OpenAI's first chunk of each choice carries the role only.
            yield chunk([ChatCompletionResponseStreamChoice(
                index=k, delta=DeltaMessage(role="assistant", content="")) for k in range(n)])
            async with aclosing(gen) as results:
                async for res in results:
                    choices = []
                    for out in res.outputs:
                        k = out.index
                        if done[k]:
                            continue
                        finished = out.finish_reason is not None
                        end = visible_text_end(out.text, sent_chars[k], finished, holdback)
                        text = out.text[sent_chars[k]:end]
                        new_tokens = out.token_ids[sent_tokens[k]:]
                        if not text and not new_tokens and not finished:
                            continue
                        lps = None
                        if request.logprobs and out.logprobs is not None:
                            lps = chat_logprobs(new_tokens, out.logprobs[sent_tokens[k]:len(out.token_ids)],
                                                request.top_logprobs or 0)
                        sent_chars[k], sent_tokens[k], done[k] = end, len(out.token_ids), finished
                        choices.append(ChatCompletionResponseStreamChoice(
                            index=k, delta=DeltaMessage(content=text), logprobs=lps,
                            finish_reason=out.finish_reason, stop_reason=out.stop_reason))
                    if choices:
                        yield chunk(choices)
            if include_usage:
                num_prompt, num_generated = len(prompt_token_ids), sum(sent_tokens)
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                    total_tokens=num_prompt + num_generated)).model_dump_json())
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse_error(e, request_id)
        yield "data: [DONE]\n\n"


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int) -> ChatCompletionLogProbs:
    """Per token: its text, logprob and UTF-8 bytes, and the `num_top` most likely tokens."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry[tid]
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda lp: lp.rank)
        content.append(ChatCompletionLogProbsContent(
            token=sampled.decoded_token or "", logprob=clamp_logprob(sampled.logprob),
            bytes=list((sampled.decoded_token or "").encode()),
            top_logprobs=[ChatCompletionLogProb(token=lp.decoded_token or "",
                                                logprob=clamp_logprob(lp.logprob),
                                                bytes=list((lp.decoded_token or "").encode()))
                          for lp in top]))
    return ChatCompletionLogProbs(content=content)
