"""What the routers and the app's error handlers share: the error body in the shape of the
API a request called, pydantic's errors as one message, and cancelling a handler whose client
went away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic_core import ErrorDetails

from jaxserve.api_server.messages_protocol import anthropic_error_response
from jaxserve.api_server.serving import error_response

T = TypeVar("T")

# Not an HTTP status a client sees: nginx's "client closed request", for logs.
CLIENT_CLOSED_REQUEST = 499


def route_path(scope: Mapping[str, Any]) -> str:
    """The request's path without --root-path (uvicorn puts it in front of the path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def api_error(scope: Mapping[str, Any], message: str, status: HTTPStatus,
              param: str | None = None) -> JSONResponse:
    """The error in the shape of the API the request called: Anthropic's under /v1/messages."""
    if route_path(scope).startswith("/v1/messages"):
        return anthropic_error_response(message, status)
    return error_response(message, status, param)


def describe_validation_errors(errors: Sequence[ErrorDetails]) -> tuple[str, str | None]:
    """pydantic's errors -> (message, param). The field path keeps field names and list
    indices and drops pydantic's union-branch tags ("list[int]", "function-after[...]");
    among a union's alternatives, our own checks (value errors) explain best, then a broken
    constraint, then a type mismatch."""
    def path(err: ErrorDetails) -> str:
        parts = [str(p) for p in err.get("loc", ())
                 if p != "body" and (isinstance(p, int) or str(p).isidentifier())]
        return ".".join(parts)

    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        loc = errors[0].get("loc", ())
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"the body is not valid JSON ({errors[0].get('msg')}{where})", None
    # Our own checks first, then broken constraints (too short, out of range), then the
    # type mismatches every other union branch reports.
    best = min(errors, key=lambda e: 0 if e.get("type") == "value_error"
               else 2 if str(e.get("type", "")).endswith("_type") else 1)
    param = path(best) or None
    msg = str(best.get("msg", "invalid value")).removeprefix("Value error, ")
    fields = {path(e) for e in errors}
    more = f" (and {len(fields) - 1} more fields)" if len(fields) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


async def run_until_disconnected(raw: Request, handler: Awaitable[T]) -> T | Response:
    """Run `handler`, cancelling it if the client disconnects first: the
    cancellation closes its generators, which abort the request in the engine.
    (A streaming response is watched by Starlette itself once it is returned.)"""
    task = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        task.cancel()
        raise
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
