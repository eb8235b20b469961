"""What the Messages and Responses APIs share: each is served as a translation of a chat request
(so the chat template, tool-call and reasoning parsers, grammars and every check are the chat
endpoint's own). This builds the chat request from a translated body and reads the chat path's
stream back as JSON events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, suppress
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from jaxserve.api_server.protocol import ChatCompletionRequest
from jaxserve.api_server.serving import OpenAIError


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request of a translated body; a field it gets wrong is a 400 naming it."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise OpenAIError(f"{where}: {err.get('msg')}" if where else str(err.get("msg")),
                          param=where or None) from None


async def chat_events(reply: StreamingResponse) -> AsyncGenerator[dict[str, Any], None]:
    """The chat stream's JSON events (its SSE `data:` lines but `[DONE]`)."""
    buffer = ""
    body = reply.body_iterator
    assert isinstance(body, AsyncGenerator)  # the chat path streams from a generator
    # Closed with this generator: a client that goes away aborts the chat stream's request.
    async with aclosing(body) as pieces:
        async for piece in pieces:
            buffer += piece if isinstance(piece, str) else bytes(piece).decode()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                for line in event.splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        yield json.loads(line[len("data: "):])


async def with_heartbeat(events: AsyncIterator[dict[str, Any]], interval_s: float
                         ) -> AsyncGenerator[dict[str, Any] | None, None]:
    """`events`, with a None each `interval_s` that passes without one (a long prefill): the
    caller sends a keep-alive so that clients and proxies do not time the stream out."""
    pending: asyncio.Future[dict[str, Any]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    finally:
        # Finished before `events` is closed: aclose() refuses a generator still running.
        if pending is not None and not pending.done():
            pending.cancel()
            with suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
