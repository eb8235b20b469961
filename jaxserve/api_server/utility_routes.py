"""vLLM's utility routes: /v1/models, /tokenize and /detokenize (bodies in
utility_protocol.py)."""

from __future__ import annotations

from fastapi import APIRouter

from jaxserve.api_server.serving import OpenAIError, ServingContext
from jaxserve.api_server.utility_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)


def utility_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def show_models() -> ModelList:
        # root is the served name, not the checkpoint's path on this machine.
        return ModelList(data=[ModelCard(id=name, root=name, max_model_len=ctx.max_model_len)
                               for name in ctx.served_model_names])

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = await ctx.render_chat(body.messages, body.add_generation_prompt,
                                         body.continue_final_message, body.chat_template_kwargs,
                                         body.chat_template, tools)
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokens = await ctx.tokenize(text, "messages" if body.messages is not None else "prompt",
                                    add_special_tokens=add_special)
        strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens,
                                token_strs=strs)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= ctx.vocab_size):
            raise OpenAIError(f"tokens must be in [0, {ctx.vocab_size})", param="tokens")
        ctx.need_tokenizer("tokens")
        return DetokenizeResponse(prompt=await ctx.off_loop(ctx.tokenizer.decode, body.tokens))

    return router
