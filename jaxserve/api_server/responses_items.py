"""The Responses API's items and tools as chat messages and tools, and back: what the handler
(jaxserve/api_server/serving_responses.py) translates, without a model or a store.

Function tools become chat tools; a `namespace` tool (Codex groups its tools so) is flattened
into its functions, and a call of one comes back as a function_call item naming its namespace.
Hosted tools the server cannot run (web_search, file_search, ...) are skipped with a warning,
unless tool_choice names one (a 400).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jaxserve.api_server.protocol import random_uuid
from jaxserve.api_server.serving import OpenAIError, sse

logger = logging.getLogger("jaxserve.api_server")

_TEXT_PARTS = {"input_text", "output_text", "text"}


class StreamEvents:
    """The Responses stream's events for a reply arriving as chat deltas: each output item is
    opened when its first delta arrives and closed when another kind starts or the reply ends."""

    def __init__(self, names: ToolNames | None = None) -> None:
        self.names = names or ToolNames()
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    def emit(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n" + sse(json.dumps(event))

    def delta(self, d: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        """The events of one chat delta; `logprobs` (chat's, for its tokens) go with its text."""
        out: list[str] = []
        reasoning = d.get("reasoning") or d.get("reasoning_content")
        if reasoning:
            out += self._text("reasoning", reasoning)
        if d.get("content"):
            out += self._text("message", d["content"], logprobs or [])
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

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None
              ) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            item = (reasoning_item("") if kind == "reasoning" else message_item(""))
            out += self._start(item)
            if kind == "message":
                out.append(self.emit("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items), content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": [],
                                           "logprobs": []}))
        current = self.open
        assert current is not None
        current["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {}
        if kind == "message":
            extra = {"logprobs": logprobs or []}
            current["content"][0]["logprobs"] += extra["logprobs"]
        out.append(self.emit(name, item_id=current["id"], output_index=len(self.items),
                             content_index=0, delta=text, **extra))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        fn = call.get("function") or {}
        item = self.calls.get(call["index"])
        if item is None or item is not self.open:
            item = function_call_item(call.get("id") or f"call_{random_uuid()}",
                                      fn.get("name") or "", "", self.names)
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
                                 content_index=0, text=part["text"], logprobs=part["logprobs"]))
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
                  "function": {"name": self.names.chat_name(i.get("namespace"), i["name"]),
                               "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        reasoning = "".join(i["content"][0]["text"] for i in self.items
                            if i["type"] == "reasoning")
        return {"content": content, "tool_calls": calls or None, "reasoning": reasoning or None}



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


def input_messages(items: str | list[dict[str, Any]], names: ToolNames | None = None
                   ) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages, an assistant's function calls (joined
    into one assistant message) and their outputs (tool messages); a reasoning item is kept as
    the next assistant message's reasoning. Other item types are refused, naming them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    names = names or ToolNames()
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
                    "function": {"name": names.chat_name(item.get("namespace"),
                                                         str(item.get("name") or "")),
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


class ToolNames:
    """The chat function names of a request's tools. A namespace's function keeps its own name
    unless another tool has it too; then it is `namespace.name`."""

    def __init__(self, pairs: list[tuple[str | None, str]] | None = None) -> None:
        pairs = pairs or []
        counts: dict[str, int] = {}
        for _, name in pairs:
            counts[name] = counts.get(name, 0) + 1
        self.to_chat = {(ns, name): name if ns is None or counts[name] == 1 else f"{ns}.{name}"
                        for ns, name in pairs}
        self.from_chat = {chat: pair for pair, chat in self.to_chat.items()}

    def chat_name(self, namespace: Any, name: str) -> str:
        ns = namespace if isinstance(namespace, str) and namespace else None
        return self.to_chat.get((ns, name), name)

    def split(self, chat_name: str) -> tuple[str | None, str]:
        return self.from_chat.get(chat_name, (None, chat_name))


def chat_tools(tools: list[dict[str, Any]] | None, choice: Any
               ) -> tuple[list[dict[str, Any]], ToolNames, Any]:
    """The request's function tools (namespaces flattened) as chat tools, their names, and
    tool_choice. Tools the server cannot run are skipped with a warning, unless tool_choice
    names one."""
    functions: list[tuple[str | None, dict[str, Any]]] = []
    skipped: list[str] = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "function":
            functions.append((None, tool))
        elif kind == "namespace":
            ns = tool.get("name")
            if not isinstance(ns, str) or not ns:
                raise OpenAIError(f"tools[{i}]: a namespace needs a name", param="tools")
            inner_tools = tool.get("tools")
            if not isinstance(inner_tools, list):
                raise OpenAIError(f"tools[{i}]: a namespace's tools must be a list", param="tools")
            for inner in inner_tools:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    functions.append((ns, inner))
                else:
                    skipped.append(f"{ns}.{inner.get('name') if isinstance(inner, dict) else inner}")
        else:
            skipped.append(str(kind))
    for i, (_, fn) in enumerate(functions):
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIError(f"tools: function {i} needs a name", param="tools")
    names = ToolNames([(ns, fn["name"]) for ns, fn in functions])
    out = []
    for ns, fn in functions:
        spec: dict[str, Any] = {k: fn[k] for k in ("description", "parameters", "strict")
                                if k in fn}
        out.append({"type": "function",
                    "function": {"name": names.chat_name(ns, fn["name"]), **spec}})
    if skipped:
        logger.warning("Responses API: skipped tools the server cannot run: %s",
                       ", ".join(s[:40] for s in skipped[:10]))
    return out, names, chat_tool_choice(choice, names, skipped)


def chat_tool_choice(choice: Any, names: ToolNames, skipped: list[str]) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function" and choice.get("name"):
        return {"type": "function", "function": {
            "name": names.chat_name(choice.get("namespace"), choice["name"])}}
    if kind in skipped:
        raise OpenAIError(f"tool_choice names {kind!r:.40}, a tool the server cannot run "
                          "(only function tools)", param="tool_choice")
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


def message_item(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{random_uuid()}", "status": "in_progress",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": list(logprobs or [])}]}


def reasoning_item(text: str) -> dict[str, Any]:
    # encrypted_content: None, whatever `include` asks: the reasoning is the model's own text,
    # in `content`, and a later request replays it from there.
    return {"type": "reasoning", "id": f"rs_{random_uuid()}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": "completed"}


def function_call_item(call_id: str, chat_name: str, arguments: str,
                       names: ToolNames) -> dict[str, Any]:
    namespace, name = names.split(chat_name)
    item = {"type": "function_call", "id": f"fc_{random_uuid()}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def output_items(message: dict[str, Any], names: ToolNames | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A chat reply's message as output items: reasoning, then text, then function calls."""
    items = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(reasoning))
    if message.get("content"):
        item = message_item(message["content"], logprobs)
        item["status"] = "completed"
        items.append(item)
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        items.append(function_call_item(call.get("id") or f"call_{random_uuid()}",
                                        fn.get("name") or "", fn.get("arguments") or "",
                                        names or ToolNames()))
    return items
