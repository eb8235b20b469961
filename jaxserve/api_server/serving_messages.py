"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (Claude Code, the
`anthropic` SDK), served as a translation of the chat path, as vLLM serves it.

A Messages request becomes a chat request: `system` -> a system message, `tool_use` blocks ->
an assistant's tool calls, `tool_result` blocks -> tool messages, `thinking` blocks -> the
assistant's reasoning, `input_schema` tools -> function tools, `tool_choice` any/tool -> required
or a named function, `stop_sequences` -> stop. The chat reply becomes content blocks (thinking,
text, tool_use); its stream becomes Anthropic's events, in Anthropic's order.

`max_tokens` is required, and a value beyond the context left is served up to what is left
(`stop_reason: "max_tokens"`): Anthropic's clients ask for tens of thousands whatever the
model's context (Claude Code sends 32,000), and vLLM refuses that as a chat request would,
which leaves a small-context model unusable from them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response, StreamingResponse

from jaxserve.api_server.chat_translation import chat_events, chat_request, with_heartbeat
from jaxserve.api_server.messages_protocol import (
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    anthropic_error_body,
)
from jaxserve.api_server.protocol import ChatCompletionRequest, random_uuid
from jaxserve.api_server.serving import OpenAIError
from jaxserve.api_server.serving_chat import OpenAIServingChat

logger = logging.getLogger("jaxserve.api_server")

PING_INTERVAL_S = 10.0  # a `ping` event while the reply has not moved (a long prefill)
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.ctx = chat.ctx

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, int]:
        """The prompt's tokens, as the same body is then billed: usage.input_tokens plus
        usage.cache_read_input_tokens."""
        self.ctx.check_model(request.model)
        _, token_ids, _ = await self.chat.render_prompt(translate(request))
        return {"input_tokens": len(token_ids)}

    async def create_message(self, request: MessagesRequest) -> Response:
        """Translate, run the chat path, translate back; raises OpenAIError for a bad request
        (sent in Anthropic's envelope by the app)."""
        self.ctx.check_model(request.model, generates=True)
        chat = translate(request)
        reply = await self.chat.create_chat_completion(chat, fit_max_tokens=True,
                                                       prompt_details=True)
        message_id = f"msg_{random_uuid()}"
        if request.stream:
            assert isinstance(reply, StreamingResponse)
            return StreamingResponse(self._stream(request, message_id, reply),
                                     media_type="text/event-stream")
        body = json.loads(bytes(reply.body))
        choice = body["choices"][0]
        if choice.get("finish_reason") == "error":  # the grammar could not go on
            raise OpenAIError(str(choice.get("stop_reason") or "generation failed"))
        stop_reason, stop_sequence = stop_of(choice, request.stop_sequences,
                                             bool(choice["message"].get("tool_calls")))
        message = {"id": message_id, "type": "message", "role": "assistant",
                   "model": self.ctx.model_name, "content": content_blocks(choice["message"]),
                   "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                   "usage": usage_of(body.get("usage"))}
        return Response(json.dumps(message), media_type="application/json")

    async def _stream(self, request: MessagesRequest, message_id: str,
                      reply: StreamingResponse) -> AsyncIterator[str]:
        events = MessageEvents()
        started = False
        finish, stop_reason, usage = None, None, None
        async with (aclosing(chat_events(reply)) as chat_stream,
                    aclosing(with_heartbeat(chat_stream, PING_INTERVAL_S)) as beating):
            async for data in beating:
                if data is None:
                    if started:  # nothing goes before message_start
                        yield events.emit("ping")
                    continue
                usage = data.get("usage") or usage
                if not started:  # the chat stream's first chunk carries the prompt's usage
                    started = True
                    yield events.emit("message_start", message={
                        "id": message_id, "type": "message", "role": "assistant",
                        "model": self.ctx.model_name, "content": [], "stop_reason": None,
                        "stop_sequence": None, "usage": usage_of(usage, output=False)})
                    yield events.emit("ping")
                if "error" in data:  # in-band: the reply ends here
                    for e in events.close():
                        yield e
                    err = data["error"]
                    body = anthropic_error_body(str(err.get("message")),
                                                HTTPStatus(int(err.get("code") or 500)))
                    yield events.emit("error", error=body["error"])
                    return
                for choice in data.get("choices") or []:
                    for e in events.delta(choice.get("delta") or {}):
                        yield e
                    finish = choice.get("finish_reason") or finish
                    stop_reason = choice.get("stop_reason") or stop_reason
        for e in events.close():
            yield e
        reason, sequence = stop_of({"finish_reason": finish, "stop_reason": stop_reason},
                                   request.stop_sequences, events.called)
        yield events.emit("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                          usage=usage_of(usage))
        yield events.emit("message_stop")


class MessageEvents:
    """Anthropic's content-block events for a reply arriving as chat deltas: a block opens with
    its first delta and closes when another kind (or another tool call) starts, or at the end."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.call: int | None = None  # the chat tool call it streams (tool_use blocks)
        self.called = False  # a tool_use block was sent

    @staticmethod
    def emit(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def delta(self, d: dict[str, Any]) -> list[str]:
        out: list[str] = []
        reasoning = d.get("reasoning") or d.get("reasoning_content")
        if reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if d.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d["content"]}))
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if self.open != "tool_use" or self.call != call.get("index"):
                out += self._open("tool_use", {"type": "tool_use", "name": fn.get("name") or "",
                                               "id": call.get("id") or f"toolu_{random_uuid()}",
                                               "input": {}}, force=True)
                self.call, self.called = call.get("index"), True
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": fn["arguments"]}))
        return out

    def _open(self, kind: str, block: dict[str, Any], force: bool = False) -> list[str]:
        if self.open == kind and not force:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [self.emit("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return self.emit("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # no signature: the reasoning is the model's own text
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open, self.call = None, None
        return out + [self.emit("content_block_stop", index=self.index)]


# ---- translation -------------------------------------------------------------------------


def translate(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) body asks for."""
    messages = conversation(request.messages)
    if request.system:
        messages.insert(0, {"role": "system", "content": _texts(request.system, "system")})
    final_prefill = request.messages[-1].role == "assistant"
    body: dict[str, Any] = {"model": request.model, "messages": messages,
                            # A final assistant message is a prefill the reply continues.
                            "add_generation_prompt": not final_prefill,
                            "continue_final_message": final_prefill}
    tools, choice = chat_tools(request.tools, request.tool_choice)
    if tools:
        body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = choice
    if (request.tool_choice or {}).get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False
    if (request.thinking or {}).get("type") == "disabled":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(request, MessagesRequest):
        body["max_completion_tokens"] = request.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat_request(body)


def _texts(content: str | list[dict[str, Any]], where: str) -> str:
    """A string, or text blocks joined (system prompts and tool results)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind != "text":
            raise OpenAIError(f"{where}[{j}]: block type {kind!r:.40} is not supported here "
                              "(text only)", param=where)
        texts.append(str(block.get("text") or ""))
    return "\n".join(texts)


def conversation(messages: list[MessageParam]) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages. A `tool_result` must answer a `tool_use` of the
    assistant message just before it, and each `tool_use` must be answered by the next
    message (Anthropic's rules). A system message inside the conversation joins the user turn
    beside it."""
    out: list[dict[str, Any]] = []
    unanswered: dict[str, int] = {}  # tool_use id -> the message that made it
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        # Any: the blocks are the client's JSON, checked one by one below.
        blocks: list[Any] = ([{"type": "text", "text": m.content}] if isinstance(m.content, str)
                             else m.content)
        if m.role == "system":
            # Into the user turn beside it, not a chat system message: many chat templates
            # (Qwen3's, ...) refuse a system message anywhere but first.
            text = _texts(m.content, f"{where}.content")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + text
            else:
                out.append({"role": "user", "content": text})
            continue
        if unanswered and m.role == "assistant":
            raise OpenAIError(f"{where}: tool_use ids were found without tool_result blocks "
                              f"immediately after: {', '.join(unanswered)}", param="messages")
        if m.role == "assistant":
            out.append(_assistant(blocks, where, unanswered))
            continue
        texts = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text") or ""))
            elif kind == "tool_result":
                use_id = block.get("tool_use_id")
                if not isinstance(use_id, str) or use_id not in unanswered:
                    raise OpenAIError(f"{where}.content[{j}]: tool_result's tool_use_id "
                                      f"{use_id!r:.80} answers no tool_use of the assistant "
                                      "message just before it", param=f"{where}.content")
                del unanswered[use_id]
                result = block.get("content")
                text = _texts(result, f"{where}.content[{j}].content") if result is not None else ""
                out.append({"role": "tool", "tool_call_id": use_id,
                            "content": f"Error: {text}" if block.get("is_error") else text})
            elif kind in ("image", "document"):
                raise OpenAIError(f"{where}.content[{j}]: {kind} blocks need a multimodal model; "
                                  "this model reads text only", param=f"{where}.content")
            else:
                raise OpenAIError(f"{where}.content[{j}]: content block type {kind!r:.40} is not "
                                  "supported (text, tool_result, image)", param=f"{where}.content")
        if unanswered:
            raise OpenAIError(f"{where}: tool_use ids were found without tool_result blocks "
                              f"immediately after: {', '.join(unanswered)}", param="messages")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[Any], where: str, unanswered: dict[str, int]
               ) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text") or ""))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue  # another model's encrypted reasoning: nothing this one can read
        elif kind == "tool_use":
            use_id, name = block.get("id"), block.get("name")
            if not isinstance(use_id, str) or not use_id or not isinstance(name, str):
                raise OpenAIError(f"{where}.content[{j}]: tool_use needs an id and a name",
                                  param=f"{where}.content")
            unanswered[use_id] = j
            calls.append({"id": use_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(block.get("input") or {})}})
        else:
            raise OpenAIError(f"{where}.content[{j}]: content block type {kind!r:.40} is not "
                              "supported in an assistant message (text, thinking, tool_use)",
                              param=f"{where}.content")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None
               ) -> tuple[list[dict[str, Any]], Any]:
    """Client tools (with an `input_schema`) as function tools, and tool_choice. Anthropic's
    server tools (web_search_20250305, ...) cannot run here: skipped with a warning, unless
    tool_choice names one (a 400)."""
    out, skipped = [], []
    for i, tool in enumerate(tools or []):
        name = tool.get("name")
        if "input_schema" not in tool:
            skipped.append(str(name or tool.get("type")))
            continue
        if not isinstance(name, str) or not name:
            raise OpenAIError(f"tools[{i}]: a tool needs a name", param="tools")
        fn = {"name": name, "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    if skipped:
        logger.warning("Messages API: skipped tools the server cannot run: %s",
                       ", ".join(s[:40] for s in skipped[:10]))
    if choice is None:
        return out, None
    kind = choice.get("type")
    if not isinstance(kind, str):
        raise OpenAIError("tool_choice.type must be a string", param="tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if name in skipped:
            raise OpenAIError(f"tool_choice names {name!r:.40}, a server tool jaxserve cannot run",
                              param="tool_choice")
        return out, {"type": "function", "function": {"name": name}}
    if kind not in _CHOICES:
        raise OpenAIError(f"tool_choice type {kind!r:.40} is not supported (auto, any, tool, "
                          "none)", param="tool_choice")
    return out, _CHOICES[kind]


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply's message as content blocks: thinking, text, then tool_use."""
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        try:
            tool_input = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            tool_input = None
        if not isinstance(tool_input, dict):  # the parser passed text that is not an object
            tool_input = {"arguments": fn.get("arguments") or ""}
        blocks.append({"type": "tool_use", "id": call.get("id") or f"toolu_{random_uuid()}",
                       "name": fn.get("name") or "", "input": tool_input})
    return blocks


def stop_of(choice: dict[str, Any], stop_sequences: list[str] | None, called: bool
            ) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish. A reply with tool
    calls stops for them (chat says "stop" when tool_choice named the function)."""
    finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "tool_calls" or (called and finish != "length"):
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage_of(usage: dict[str, Any] | None, output: bool = True) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's tokens the prefix cache did not serve
    (those are cache_read_input_tokens), as Anthropic counts its own cache."""
    u = usage or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": int(u.get("prompt_tokens") or 0) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": int(u.get("completion_tokens") or 0) if output else 0}
