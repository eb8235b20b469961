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


# At most this many fields are described in one message, each input echoed up to this many
# characters: a body of thousands of bad items must not make a megabyte error.
MAX_DESCRIBED_FIELDS = 5
MAX_ECHOED_INPUT_CHARS = 100
# Our own checks (ValueError in a validator) explain themselves: their sentence is the
# message, without pydantic's tag. Every other error names pydantic's type, as vLLM's do.
_OWN_SENTENCES = ("value_error", "assertion_error")


def _echoed_input(value: Any) -> str:
    """pydantic's `input_value=..., input_type=...`, bounded: containers by their size."""
    if isinstance(value, (list, tuple, dict, set)):
        return f"input_type={type(value).__name__} of {len(value)} items"
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<{type(value).__name__}>"
    if len(text) > MAX_ECHOED_INPUT_CHARS:
        text = text[:MAX_ECHOED_INPUT_CHARS] + "..."
    return f"input_value={text}, input_type={type(value).__name__}"


def describe_validation_errors(errors: Sequence[ErrorDetails]) -> tuple[str, str | None]:
    """pydantic's errors -> (message, param). One error for each top-level field the body got
    wrong, named by its path (field names and list indices, without pydantic's union-branch
    tags such as "list[int]"): among a field's errors (a union's alternatives report one
    each) our own checks (value errors) explain best, then a broken constraint, then a type
    mismatch. Each carries pydantic's type as pydantic's own string does (`[type=
    less_than_equal, input_value=..., input_type=int]`), so a client matching vLLM's bodies
    for `literal_error` or `less_than_equal` finds it. `param` is the best-explained one."""
    def path(err: ErrorDetails) -> str:
        parts = [str(p) for p in err.get("loc", ())
                 if p != "body" and (isinstance(p, int) or str(p).isidentifier())]
        return ".".join(parts)

    def rank(err: ErrorDetails) -> int:
        kind = str(err.get("type", ""))
        return 0 if kind in _OWN_SENTENCES else 2 if kind.endswith("_type") else 1

    def describe(err: ErrorDetails) -> str:
        where = path(err)
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        # A sentence that starts with its field's name names it already (vLLM's logit_bias').
        text = f"{where}: {msg}" if where and not msg.startswith(f"{where} ") else msg
        kind = str(err.get("type", ""))
        if kind in _OWN_SENTENCES:
            return text
        tag = f"type={kind}"
        if kind != "missing":  # a missing field's input is its parent
            tag += f", {_echoed_input(err.get('input'))}"
        return f"{text} [{tag}]"

    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        loc = errors[0].get("loc", ())
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"the body is not valid JSON ({errors[0].get('msg')}{where}) [type=json_invalid]", None
    # One error a top-level field (its best), the best-explained field first.
    by_field: dict[str, ErrorDetails] = {}
    for err in sorted(errors, key=rank):  # stable: pydantic's order among equals
        by_field.setdefault(path(err).split(".")[0], err)
    fields = list(by_field.values())  # in rank order: inserted so
    param = path(fields[0]) or None
    message = "; ".join(describe(e) for e in fields[:MAX_DESCRIBED_FIELDS])
    if len(fields) > MAX_DESCRIBED_FIELDS:
        message += f" (and {len(fields) - MAX_DESCRIBED_FIELDS} more fields)"
    return message, param


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
