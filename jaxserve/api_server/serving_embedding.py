"""POST /v1/embeddings and vLLM's /pooling: one vector per input (or per input token, or a
classifier's probabilities), from the served model.

Each input is an engine request of its own (a pooling request: jaxserve/pooling_params.py),
run by the same engine and batch as generation, its prompt pooled as --pooler-config says.
"""

from __future__ import annotations

import base64
import sys
import time
from contextlib import aclosing
from http import HTTPStatus
from typing import Any, overload

import numpy as np
from fastapi.responses import Response

from jaxserve.api_server.embedding_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingInputRequest,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
)
from jaxserve.api_server.protocol import UsageInfo, random_uuid
from jaxserve.api_server.serving import (
    OpenAIError,
    ServingContext,
    merge_async_iterators,
)
from jaxserve.engine.processor import InvalidInputError
from jaxserve.outputs import EmbeddingRequestOutput


@overload
def encode_vector(vector: list[float], encoding_format: str, embed_dtype: str = ...,
                  endianness: str = ...) -> list[float] | str: ...
@overload
def encode_vector(vector: list[list[float]], encoding_format: str, embed_dtype: str = ...,
                  endianness: str = ...) -> list[list[float]] | str: ...
def encode_vector(vector: list[float] | list[list[float]], encoding_format: str,
                  embed_dtype: str = "float32", endianness: str = "native"
                  ) -> list[float] | list[list[float]] | str:
    """The vector as JSON floats, or base64 of its bytes as `embed_dtype` in `endianness`
    (vLLM's; the default, native float32, is what the openai SDK decodes with numpy); a
    token_embed's vectors are encoded row after row."""
    if encoding_format != "base64":
        return vector
    import ml_dtypes  # bfloat16 and float8: numpy has neither

    dtype = np.dtype({"float32": np.float32, "float16": np.float16,
                      "bfloat16": ml_dtypes.bfloat16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
                      "fp8_e5m2": ml_dtypes.float8_e5m2}[embed_dtype])
    values = np.asarray(vector, np.float32).ravel().astype(dtype)
    if dtype.itemsize > 1 and endianness not in ("native", sys.byteorder):
        # Swapped as unsigned ints: ml_dtypes' types have no byte order of their own.
        values = values.view(f"u{dtype.itemsize}").byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


class OpenAIServingEmbedding:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_embedding(self, request: EmbeddingRequest | PoolingRequest,
                               pooling: bool = False) -> Response:
        """Validate, embed every input, answer in input order (`pooling`: vLLM's /pooling
        shape and its `task`); raises OpenAIError for a bad request."""
        ctx = self.ctx
        received = time.time()
        ctx.check_model(request.model)
        task = getattr(request, "task", None) or (
            "classify" if pooling and ctx.processor.classifier is not None else "embed")
        if pooling:
            self.check_pooling_task(task)
        inputs = await self.inputs(request)
        request_id = f"{'pool' if pooling else 'embd'}-{random_uuid()}"
        vectors = await self.embed(request_id, inputs, received, self._normalize(request),
                                   request.dimensions, request.priority, task=task)
        num_tokens = sum(len(ids) for ids in inputs)
        usage = UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        fmt = request.encoding_format
        if pooling:
            body: Any = PoolingResponse(
                id=request_id, model=ctx.model_name, usage=usage,
                data=[PoolingResponseData(index=i, data=encode_vector(
                    v, fmt, request.embed_dtype, request.endianness))
                      for i, v in enumerate(vectors)])
        else:
            body = EmbeddingResponse(
                id=request_id, model=ctx.model_name, usage=usage,
                data=[EmbeddingResponseData(index=i, embedding=encode_vector(
                    v, fmt, request.embed_dtype, request.endianness))
                      for i, v in enumerate(vectors)])
        return Response(body.model_dump_json(), media_type="application/json")

    def supported_tasks(self) -> tuple[str, ...]:
        """The /pooling tasks the served model serves: a sequence classifier classifies,
        any other model embeds (a vector per prompt, or per prompt token)."""
        return ("classify",) if self.ctx.processor.classifier is not None else (
            "embed", "token_embed")

    def check_pooling_task(self, task: str) -> None:
        """A /pooling task the model does not serve is refused in vLLM's words (clients match
        their start, "Unsupported task: 'classify'"), then why, where jaxserve knows."""
        supported = self.supported_tasks()
        if task in supported:
            return
        why = ""
        try:
            self.ctx.processor.check_task(task)
        except InvalidInputError as e:
            why = f". {e}"
        raise OpenAIError(f"Unsupported task: {task!r} Supported tasks: {supported}{why}",
                          param="task")

    async def embed(self, request_id: str, inputs: list[list[int]], received: float,
                    normalize: bool | None = None, dimensions: int | None = None,
                    priority: int = 0, param: str = "input", task: str = "embed") -> list[Any]:
        """The results of `task` for `inputs` (token ids), each its own engine request, in
        order: vectors (embed), probabilities (classify, score) or vectors per token."""
        ctx = self.ctx
        spans = [("tokenize", received, time.time())]
        try:
            params = ctx.processor.pooling_params(normalize, dimensions, task)
            for ids in inputs:
                ctx.processor.check_pooling_prompt(ids)
        except InvalidInputError as e:
            raise OpenAIError(str(e), param=param if e.param == "prompt" else e.param) from None
        arrival = time.monotonic()
        gens = []
        for i, ids in enumerate(inputs):
            rid = f"{request_id}-{i}"
            gens.append(ctx.client.encode(
                rid, ids, params, priority=priority, arrival_time=arrival,
                trace=ctx.start_trace(rid, received, spans)))
        final: list[Any] = [None] * len(inputs)
        async with aclosing(merge_async_iterators(*gens)) as results:
            async for i, res in results:
                final[i] = res
        return [self._vector(r) for r in final]

    @staticmethod
    def _vector(res: EmbeddingRequestOutput | None) -> list[Any]:
        if res is None or res.outputs is None:
            raise OpenAIError("the engine ended the request without its embedding",
                              HTTPStatus.INTERNAL_SERVER_ERROR)
        return res.outputs.embedding

    @staticmethod
    def _normalize(request: PoolingInputRequest) -> bool | None:
        given = {v for v in (request.use_activation, getattr(request, "normalize", None))
                 if v is not None}
        if len(given) > 1:
            raise OpenAIError("use_activation and normalize are one setting (use_activation is "
                              "vLLM's newer name): they disagree", param="use_activation")
        return given.pop() if given else None

    async def inputs(self, request: PoolingInputRequest) -> list[list[int]]:
        """Each input's token ids (texts tokenized off the event loop), truncated as asked;
        chat `messages` are one input, the template applied."""
        if (request.input is None) == (request.messages is None):
            raise OpenAIError("give exactly one of input and messages", param="input")
        keep, side = request.truncate_prompt_tokens, request.truncation_side
        if request.messages is not None:
            text = await self.ctx.render_chat(request.messages, request.add_generation_prompt,
                                              request.continue_final_message,
                                              request.chat_template_kwargs)
            # The template holds the special tokens (BOS etc.), as for chat.
            ids = await self.ctx.tokenize(text, "messages", truncating=keep is not None,
                                          add_special_tokens=False)
            return [self.ctx.truncate(ids, keep, side)]
        raw = request.input
        assert raw is not None  # exactly one of input and messages (checked above)
        # Any: one text, texts, one token-id prompt or several, told apart here.
        items: list[Any] = [raw] if isinstance(raw, str) else raw
        if isinstance(items[0], int):
            items = [items]
        out = []
        for item in items:
            if isinstance(item, str):
                ids = await self.ctx.tokenize(item, "input",
                                              truncating=request.truncate_prompt_tokens is not None,
                                              add_special_tokens=request.add_special_tokens)
            else:
                ids = list(item)
            out.append(self.ctx.truncate(ids, request.truncate_prompt_tokens,
                                         request.truncation_side))
        return out
