"""POST /v1/responses and its store: OpenAI's Responses API, served as a translation of the
chat path (jaxserve/api_server/responses_items.py translates items and tools).

A Responses request becomes a chat-completions request (input items -> messages, function and
namespace tools -> chat tools, `text.format` -> `response_format`, `max_output_tokens` ->
`max_completion_tokens`), so the chat template, tool-call and reasoning parsers, grammars and
every check are the chat endpoint's own. Its reply becomes output items (reasoning, message,
function_call); a stream's chat chunks become the Responses event sequence
(`response.created` ... `response.output_text.delta` ... `response.completed`).

`store` (default true, as in OpenAI's API) keeps the response and its conversation in memory,
the last --responses-store-size of them: `GET /v1/responses/{id}`, `DELETE`, a later request's
`previous_response_id`, and `background: true` (answered at once, `queued`; polled with GET;
`POST /v1/responses/{id}/cancel` stops it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response, StreamingResponse

from jaxserve.api_server.chat_translation import chat_events, chat_request
from jaxserve.api_server.protocol import ChatCompletionRequest, random_uuid
from jaxserve.api_server.responses_items import (
    StreamEvents,
    ToolNames,
    chat_tools,
    input_messages,
    output_items,
    response_format,
)
from jaxserve.api_server.responses_protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from jaxserve.api_server.serving import OpenAIError, error_from_exception
from jaxserve.api_server.serving_chat import OpenAIServingChat

# Fields of a Responses request that the translation handles; the rest (vLLM's sampling
# fields) pass to the chat request as they are.
_TRANSLATED = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
               "store", "previous_response_id", "metadata", "reasoning", "truncation", "include",
               "stream", "stream_options", "parallel_tool_calls", "background",
               "prompt_cache_key", "client_metadata", "safety_identifier", "service_tier",
               "top_logprobs"}


@dataclass
class Stored:
    """A stored response: its object as last sent, and the conversation it ends (for a later
    request's previous_response_id: None until it has finished)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]] | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)  # background only


class ResponseStore:
    """The last `capacity` stored responses, in memory; the oldest is evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self.items)

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        self.items.move_to_end(response_id)
        while len(self.items) > self.capacity:
            _, old = self.items.popitem(last=False)
            if old.task is not None:
                old.task.cancel()

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise OpenAIError(f"{param} {response_id!r:.80} not found (responses are kept in "
                              f"memory with store=true: the last {self.capacity})",
                              HTTPStatus.NOT_FOUND, param=param)
        return stored


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.ctx = chat.ctx
        self.store = ResponseStore(self.ctx.responses_store_size)

    async def create_response(self, request: ResponsesRequest) -> Response:
        """Translate, run the chat path, translate back; raises OpenAIError for a bad request."""
        self.ctx.check_model(request.model, generates=True)
        if request.n != 1:
            raise OpenAIError("a response has one output: n must be 1", param="n")
        if request.return_token_ids:
            raise OpenAIError("return_token_ids is for completions and chat completions",
                              param="return_token_ids")
        # An unset store is OpenAI's default (true); a server without a store keeps nothing.
        store = request.store is not False and self.store.capacity > 0
        if request.background and not store:
            raise OpenAIError("background needs store=true (and --responses-store-size > 0): "
                              "its result is fetched from the store", param="background")
        if request.background and request.stream:
            raise OpenAIError("background responses are polled with GET /v1/responses/{id}; "
                              "stream=true with background is not supported", param="stream")
        # The conversation is what the store keeps; instructions apply to this request only
        # (a previous response's are not carried over, as in OpenAI's API).
        tools, names, choice = chat_tools(request.tools, request.tool_choice)
        conversation = [*self._history(request.previous_response_id),
                        *input_messages(request.input, names)]
        if not conversation:
            raise OpenAIError("input must hold at least one item", param="input")
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        chat = self._chat_request(request, [*system, *conversation], tools, choice)
        run = Run(self, request, names, conversation, store)
        if request.background:
            return await run.start_background(chat)
        reply = await self.chat.create_chat_completion(chat, prompt_details=True)
        if request.stream:
            assert isinstance(reply, StreamingResponse)
            return StreamingResponse(run.stream(reply), media_type="text/event-stream")
        obj = await run.finish_whole(json.loads(bytes(reply.body)))
        # json.dumps: echoed fields (tools, text, reasoning) may hold lone surrogates, which
        # it escapes and pydantic's JSON writer refuses.
        return Response(json.dumps(obj), media_type="application/json")

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).response

    def delete(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored.task is not None:
            stored.task.cancel()
        del self.store.items[response_id]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Stop a background response; one that has finished is returned as it is."""
        stored = self.store.get(response_id)
        if not stored.response.get("background"):
            raise OpenAIError("only background responses can be cancelled", param="response_id")
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
            try:
                await stored.task
            except asyncio.CancelledError:
                pass
        return stored.response

    # ---- request -----------------------------------------------------------------------

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id, param="previous_response_id")
        if stored.conversation is None:
            raise OpenAIError(f"previous_response_id {previous_response_id!r} has not "
                              f"completed (status {stored.response.get('status')})",
                              param="previous_response_id")
        return list(stored.conversation)

    def _chat_request(self, request: ResponsesRequest, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]], choice: Any) -> ChatCompletionRequest:
        extra = set(request.model_extra or ())
        body = {k: v for k, v in request.model_dump(exclude_unset=True, by_alias=True).items()
                if k not in _TRANSLATED and k not in extra}
        body["messages"] = messages
        if request.max_output_tokens is not None:
            body["max_completion_tokens"] = request.max_output_tokens
        if tools:
            body["tools"] = tools
            if choice is not None:
                body["tool_choice"] = choice
        elif choice == "required" or isinstance(choice, dict):
            raise OpenAIError("tool_choice asks for a tool call, but the request has no function "
                              "tools the server can run", param="tool_choice")
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
        if ("message.output_text.logprobs" in (request.include or ())
                or request.top_logprobs is not None):
            body["logprobs"], body["top_logprobs"] = True, request.top_logprobs or 0
        fmt = response_format((request.text or {}).get("format"))
        if fmt is not None:
            body["response_format"] = fmt
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return chat_request(body)

    # ---- reply -------------------------------------------------------------------------

    def response_object(self, request: ResponsesRequest, response_id: str, created: int,
                        choice: dict[str, Any], usage: ResponseUsage | None,
                        output: list[dict[str, Any]], store: bool) -> dict[str, Any]:
        """The whole response object: its output items, status and usage."""
        finish = choice.get("finish_reason")
        status: ResponseStatus = "completed"
        incomplete, error = None, None
        if finish is None:
            status = "in_progress"
        elif finish == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif finish == "error":
            status = "failed"
            error = {"code": "server_error", "message": str(choice.get("stop_reason") or "")}
        return ResponseObject(
            id=response_id, created_at=created, status=status, model=self.ctx.model_name,
            output=output, usage=usage, error=error, incomplete_details=incomplete,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            metadata=request.metadata, parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, reasoning=request.reasoning,
            store=store, background=bool(request.background), temperature=request.temperature,
            text=request.text or {"format": {"type": "text"}},
            tool_choice=request.tool_choice or "auto", tools=request.tools or [],
            top_p=request.top_p, user=request.user).model_dump()

    @staticmethod
    def usage(usage: dict[str, Any] | None) -> ResponseUsage:
        """The Responses usage of a chat usage (whose reasoning tokens the chat path counts)."""
        u = usage or {}
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        thought = int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
        output = int(u.get("completion_tokens") or 0)
        return ResponseUsage(input_tokens=int(u.get("prompt_tokens") or 0),
                             input_tokens_details={"cached_tokens": cached},
                             output_tokens=output,
                             output_tokens_details={"reasoning_tokens": min(thought, output)},
                             total_tokens=int(u.get("total_tokens") or 0))


class Run:
    """One response being made: whole, streamed or in the background, and what it stores."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest,
                 names: ToolNames, conversation: list[dict[str, Any]], store: bool) -> None:
        self.serving, self.request, self.names = serving, request, names
        self.conversation, self.store = conversation, store
        self.id, self.created = f"resp_{random_uuid()}", int(time.time())

    def _object(self, choice: dict[str, Any], usage: ResponseUsage | None,
                output: list[dict[str, Any]]) -> dict[str, Any]:
        return self.serving.response_object(self.request, self.id, self.created, choice, usage,
                                            output, self.store)

    def _keep(self, obj: dict[str, Any], message: dict[str, Any] | None) -> None:
        if not self.store:
            return
        conversation = None
        if message is not None:
            reply = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                reply["tool_calls"] = message["tool_calls"]
            conversation = [*self.conversation, reply]
        stored = self.serving.store.items.get(self.id)
        if stored is not None:  # a background response, finished or cancelled
            stored.response, stored.conversation = obj, conversation
        elif not self.request.background:  # (a background one gone: deleted or evicted)
            self.serving.store.put(self.id, Stored(obj, conversation))

    async def finish_whole(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = body["choices"][0]
        message = choice["message"]
        usage = self.serving.usage(body.get("usage"))
        lps = (choice.get("logprobs") or {}).get("content")
        obj = self._object(choice, usage, output_items(message, self.names, lps))
        self._keep(obj, message if obj["status"] != "failed" else None)
        return obj

    async def start_background(self, chat: ChatCompletionRequest) -> Response:
        queued = self._object({"finish_reason": None}, None, [])
        queued["status"] = "queued"
        self.serving.store.put(self.id, Stored(queued))
        task = asyncio.get_running_loop().create_task(self._background(chat))
        self.serving.store.items[self.id].task = task
        return Response(json.dumps(queued), media_type="application/json")

    async def _background(self, chat: ChatCompletionRequest) -> None:
        stored = self.serving.store.items.get(self.id)
        if stored is not None:
            stored.response = {**stored.response, "status": "in_progress"}
        try:
            reply = await self.serving.chat.create_chat_completion(chat, prompt_details=True)
            await self.finish_whole(json.loads(bytes(reply.body)))
        except asyncio.CancelledError:
            obj = self._object({"finish_reason": None}, None, [])
            self._keep({**obj, "status": "cancelled"}, None)
            raise
        except Exception as e:  # noqa: BLE001 - the request has been answered: record it
            err = error_from_exception(e, f"background response {self.id}")
            obj = self._object({"finish_reason": "error", "stop_reason": err.message}, None, [])
            self._keep(obj, None)

    async def stream(self, reply: StreamingResponse) -> AsyncIterator[str]:
        events = StreamEvents(self.names)
        start = self._object({"finish_reason": None}, None, [])
        yield events.emit("response.created", response=start)
        yield events.emit("response.in_progress", response=start)
        finish, usage, stop_reason = None, None, None
        async with aclosing(chat_events(reply)) as stream:
            async for data in stream:
                if "error" in data:  # in-band: the reply ends here, as a failed response
                    for e in events.close_all():
                        yield e
                    err = data["error"]
                    yield events.emit("error", code=str(err.get("code")),
                                      message=err.get("message"), param=err.get("param"))
                    finish, stop_reason = "error", err.get("message")
                    break
                usage = data.get("usage") or usage
                for choice in data.get("choices") or []:
                    lps = (choice.get("logprobs") or {}).get("content")
                    for e in events.delta(choice.get("delta") or {}, lps):
                        yield e
                    finish = choice.get("finish_reason") or finish
                    stop_reason = choice.get("stop_reason") or stop_reason
        for e in events.close_all():
            yield e
        message = events.as_message()
        final = self._object({"finish_reason": finish or "stop", "stop_reason": stop_reason},
                             self.serving.usage(usage),
                             events.items)
        # Kept before the last event: a client may stop reading once it has it.
        self._keep(final, message if final["status"] != "failed" else None)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[final["status"]]
        yield events.emit(kind, response=final)
