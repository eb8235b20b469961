"""POST /v1/responses: OpenAI's Responses API, served as a translation of the chat path.

A Responses request becomes a chat-completions request (input items -> messages, function
tools -> chat tools, `text.format` -> `response_format`, `max_output_tokens` ->
`max_completion_tokens`), so the chat template, tool-call and reasoning parsers, grammars and
every check are the chat endpoint's own. Its reply becomes output items (reasoning, message,
function_call); a stream's chat chunks become the Responses event sequence
(`response.created` ... `response.output_text.delta` ... `response.completed`).

Stateless unless `store: true`: then the conversation and its reply are kept in memory (the
last STORE_CAPACITY stored responses) for a later request's `previous_response_id`.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from jaxserve.api_server.protocol import ChatCompletionRequest, random_uuid
from jaxserve.api_server.responses_protocol import ResponseObject, ResponsesRequest, ResponseUsage
from jaxserve.api_server.serving import OpenAIError, sse
from jaxserve.api_server.serving_chat import OpenAIServingChat

STORE_CAPACITY = 256
# Fields of a Responses request that the translation handles; the rest (vLLM's sampling
# fields) pass to the chat request as they are.
_TRANSLATED = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
               "store", "previous_response_id", "metadata", "reasoning", "truncation", "include",
               "stream", "stream_options", "parallel_tool_calls"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.ctx = chat.ctx
        self.store: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    async def create_response(self, request: ResponsesRequest) -> Response:
        """Translate, run the chat path, translate back; raises OpenAIError for a bad request."""
        if request.n != 1:
            raise OpenAIError("a response has one output: n must be 1", param="n")
        if request.return_token_ids:
            raise OpenAIError("return_token_ids is for completions and chat completions",
                              param="return_token_ids")
        # The conversation is what the store keeps; instructions apply to this request only
        # (a previous response's are not carried over, as in OpenAI's API).
        conversation = [*self._history(request.previous_response_id),
                        *input_messages(request.input)]
        if not conversation:
            raise OpenAIError("input must hold at least one item", param="input")
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        chat_request = self._chat_request(request, [*system, *conversation])
        response_id, created = f"resp_{random_uuid()}", int(time.time())
        reply = await self.chat.create_chat_completion(chat_request)
        if request.stream:
            assert isinstance(reply, StreamingResponse)
            return StreamingResponse(
                self._stream(request, response_id, created, conversation, reply),
                media_type="text/event-stream")
        body = json.loads(reply.body)
        obj = self._response(request, response_id, created, body["choices"][0], body.get("usage"))
        self._keep(request, response_id, conversation, body["choices"][0]["message"])
        # json.dumps: echoed fields (tools, text, reasoning) may hold lone surrogates, which
        # it escapes and pydantic's JSON writer refuses.
        return Response(json.dumps(obj.model_dump()), media_type="application/json")

    # ---- request -----------------------------------------------------------------------

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        if previous_response_id not in self.store:
            raise OpenAIError(f"previous_response_id {previous_response_id!r} not found (only "
                              f"responses created with store=true are kept: the last "
                              f"{STORE_CAPACITY}, in memory)", HTTPStatus.NOT_FOUND,
                              param="previous_response_id")
        return list(self.store[previous_response_id])

    def _chat_request(self, request: ResponsesRequest, messages: list[dict[str, Any]]
                      ) -> ChatCompletionRequest:
        extra = set(request.model_extra or ())
        body = {k: v for k, v in request.model_dump(exclude_unset=True, by_alias=True).items()
                if k not in _TRANSLATED and k not in extra}
        body["messages"] = messages
        if request.max_output_tokens is not None:
            body["max_completion_tokens"] = request.max_output_tokens
        if request.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(request.tools)]
        if request.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(request.tool_choice)
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
        fmt = response_format((request.text or {}).get("format"))
        if fmt is not None:
            body["response_format"] = fmt
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ()))
            raise OpenAIError(f"{where}: {err.get('msg')}" if where else str(err.get("msg")),
                              param=where or None) from None

    # ---- reply -------------------------------------------------------------------------

    def _response(self, request: ResponsesRequest, response_id: str, created: int,
                  choice: dict[str, Any],
                  usage: dict[str, Any] | None, output: list[dict[str, Any]] | None = None
                  ) -> ResponseObject:
        """The whole response object: its output items, status and usage."""
        finish = choice.get("finish_reason")
        status, incomplete, error = "completed", None, None
        if finish == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif finish == "error":
            status = "failed"
            error = {"code": "server_error", "message": str(choice.get("stop_reason") or "")}
        u = usage or {}
        return ResponseObject(
            id=response_id, created_at=created, status=status, model=self.ctx.model_name,
            output=output if output is not None else output_items(choice["message"]),
            usage=ResponseUsage(input_tokens=u.get("prompt_tokens", 0),
                                output_tokens=u.get("completion_tokens", 0),
                                total_tokens=u.get("total_tokens", 0)),
            error=error, incomplete_details=incomplete, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, metadata=request.metadata,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, reasoning=request.reasoning,
            store=bool(request.store), temperature=request.temperature,
            text=request.text or {"format": {"type": "text"}},
            tool_choice=request.tool_choice or "auto", tools=request.tools or [],
            top_p=request.top_p, user=request.user)

    def _keep(self, request: ResponsesRequest, response_id: str, messages: list[dict[str, Any]],
              message: dict[str, Any]) -> None:
        if not request.store:
            return
        reply = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        self.store[response_id] = [*messages, reply]
        while len(self.store) > STORE_CAPACITY:
            self.store.popitem(last=False)

    async def _stream(self, request: ResponsesRequest, response_id: str, created: int,
                      conversation: list[dict[str, Any]], reply: StreamingResponse
                      ) -> AsyncIterator[str]:
        events = StreamEvents()
        start = self._response(request, response_id, created, {"finish_reason": None}, None,
                               output=[])
        start.status = "in_progress"
        yield events.emit("response.created", response=start.model_dump())
        yield events.emit("response.in_progress", response=start.model_dump())
        finish, usage, stop_reason = None, None, None
        async with aclosing(chunks(reply)) as stream:
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
                    for e in events.delta(choice.get("delta") or {}):
                        yield e
                    finish = choice.get("finish_reason") or finish
                    stop_reason = choice.get("stop_reason") or stop_reason
        for e in events.close_all():
            yield e
        final = self._response(request, response_id, created,
                               {"finish_reason": finish, "stop_reason": stop_reason}, usage,
                               output=events.items)
        if final.status != "failed":  # kept before the last event: a client may stop reading
            self._keep(request, response_id, conversation, events.as_message())
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[final.status]
        yield events.emit(kind, response=final.model_dump())


class StreamEvents:
    """The Responses stream's events for a reply arriving as chat deltas: each output item is
    opened when its first delta arrives and closed when another kind starts or the reply ends."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    def emit(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n" + sse(json.dumps(event))

    def delta(self, d: dict[str, Any]) -> list[str]:
        out: list[str] = []
        reasoning = d.get("reasoning") or d.get("reasoning_content")
        if reasoning:
            out += self._text("reasoning", reasoning)
        if d.get("content"):
            out += self._text("message", d["content"])
        for call in d.get("tool_calls") or []:
            out += self._call(call)
        return out

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close_all()
        self.open = item
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []  # its part arrives with response.content_part.added
        return out + [self.emit("response.output_item.added", output_index=len(self.items),
                                item=added)]

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            item = (reasoning_item("") if kind == "reasoning" else message_item(""))
            out += self._start(item)
            if kind == "message":
                out.append(self.emit("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items), content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.emit(name, item_id=item["id"], output_index=len(self.items),
                             content_index=0, delta=text, **extra))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        fn = call.get("function") or {}
        item = self.calls.get(call["index"])
        if item is None or item is not self.open:
            item = function_call_item(call.get("id") or f"call_{random_uuid()}",
                                      fn.get("name") or "", "")
            item["status"] = "in_progress"
            self.calls[call["index"]] = item
            out += self._start(item)
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self.emit("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=len(self.items), delta=fn["arguments"]))
        return out

    def close_all(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, out = len(self.items), []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.emit("response.output_text.done", item_id=item["id"], output_index=i,
                                 content_index=0, text=part["text"], logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item["id"],
                                 output_index=i, content_index=0, part=part))
        elif item["type"] == "reasoning":
            out.append(self.emit("response.reasoning_text.done", item_id=item["id"],
                                 output_index=i, content_index=0,
                                 text=item["content"][0]["text"]))
        else:
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=i, arguments=item["arguments"]))
        item["status"] = "completed"
        self.items.append(item)
        return out + [self.emit("response.output_item.done", output_index=i, item=item)]

    def as_message(self) -> dict[str, Any]:
        """The streamed reply as a chat message (for the store)."""
        content = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return {"content": content, "tool_calls": calls or None}


async def chunks(reply: StreamingResponse) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's JSON events (its SSE `data:` lines but `[DONE]`)."""
    buffer = ""
    # Closed with this generator: a client that goes away aborts the chat stream's request.
    async with aclosing(reply.body_iterator) as pieces:
        async for piece in pieces:
            buffer += piece if isinstance(piece, str) else bytes(piece).decode()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                for line in event.splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        yield json.loads(line[len("data: "):])


# ---- translation -------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise OpenAIError(f"{where}.content[{j}]: content part type {kind!r:.40} is not "
                              f"supported (only {sorted(_TEXT_PARTS)})", param=f"{where}.content")
        texts.append(str(part.get("text") or ""))
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages, an assistant's function calls (joined
    into one assistant message) and their outputs (tool messages); a reasoning item is kept as
    the next assistant message's reasoning. Other item types are refused, naming them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise OpenAIError(f"{where}.type must be a string", param="input")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}.role must be user, system, developer or assistant, "
                                  f"got {role!r}", param="input")
            msg: dict[str, Any] = {"role": role, "content": _text_of(item.get("content"), where)}
            if role == "assistant" and reasoning:
                msg["reasoning"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                    "function": {"name": str(item.get("name") or ""),
                                 "arguments": str(item.get("arguments") or "")}}
            # An assistant turn's text and its calls are one message (a client replaying a
            # turn sends the message item, then its function_call items).
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                             "content": _text_of(output, where) if output is not None else ""})
        elif kind == "reasoning":
            parts = [p for key in ("content", "summary") if isinstance(item.get(key), list)
                     for p in item[key]]
            reasoning = "".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))
        else:
            raise OpenAIError(f"{where}: input item type {kind!r:.40} is not supported (message, "
                              "function_call, function_call_output, reasoning)", param="input")
    return messages


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise OpenAIError(f"tools[{i}]: tool type {tool.get('type')!r:.40} is not supported (only "
                          "function tools)", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice {choice!r:.80} is not supported (none, auto, required or "
                      '{"type": "function", "name": ...})', param="tool_choice")


def response_format(fmt: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None for plain text)."""
    if fmt is not None and not isinstance(fmt, dict):
        raise OpenAIError("text.format must be an object", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise OpenAIError(f"text.format type {fmt.get('type')!r:.40} is not supported (text, "
                      "json_schema, json_object)", param="text.format")


def message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{random_uuid()}", "status": "in_progress",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{random_uuid()}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{random_uuid()}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply's message as output items: reasoning, then text, then function calls."""
    items = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(reasoning))
    if message.get("content"):
        item = message_item(message["content"])
        item["status"] = "completed"
        items.append(item)
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        items.append(function_call_item(call.get("id") or f"call_{random_uuid()}",
                                        fn.get("name") or "", fn.get("arguments") or ""))
    return items
