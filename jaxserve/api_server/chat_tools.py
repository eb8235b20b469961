"""What a chat request asks of tools: its tool_choice read into a ToolMode, the grammar that
enforces "required" and a named function, and the messages and tools as chat templates read
them (vLLM's rules)."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.api_server.chat_output import ToolMode
from jaxserve.api_server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from jaxserve.api_server.tool_parsers import TOOL_PARSERS, required_tools_schema


class ToolChoiceError(ValueError):
    """A request's tools or tool_choice cannot be served; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def resolve_tool_mode(request: ChatCompletionRequest, tool_call_parser: str | None,
                      enable_auto_tool_choice: bool) -> ToolMode:
    """The request's ToolMode; raises ToolChoiceError for a choice the server cannot serve."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools else "none"
    if choice == "none":
        return ToolMode()
    if not request.tools:
        raise ToolChoiceError("tool_choice needs tools", "tool_choice")
    parallel = request.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in request.tools]
        if choice.function.name not in names:
            raise ToolChoiceError(f"tool_choice names {choice.function.name!r}, which is not in "
                                  f"tools ({', '.join(names)})", "tool_choice")
        return ToolMode("named", choice.function.name, parallel)
    if choice == "required":
        return ToolMode("required", parallel=parallel)
    if not enable_auto_tool_choice or tool_call_parser is None:
        raise ToolChoiceError(
            '"auto" tool choice (the default when tools are given) needs the server started '
            "with --enable-auto-tool-choice and --tool-call-parser; or send tool_choice "
            '"required", "none" or a named function', "tool_choice")
    return ToolMode("auto", parallel=parallel, parser=TOOL_PARSERS[tool_call_parser])


# Compact JSON (one space after ':' and ','): a free-whitespace grammar lets a small model spend
# its tokens on tabs and newlines inside the arguments.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_grammar(request: ChatCompletionRequest, mode: ToolMode) -> tuple[str, str] | None:
    """The structured output (kind, spec) that enforces "required" or a named function."""
    tools = {t.function.name: t.function.parameters for t in request.tools or ()}
    if mode.choice == "named":
        assert mode.function is not None  # "named" always names its function
        schema = dict(tools[mode.function] or {"type": "object"})
    elif mode.choice == "required":
        schema = required_tools_schema(list(tools.items()), mode.parallel)
    else:
        return None
    return "json", json.dumps({**schema, "x-guidance": COMPACT})


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools in OpenAI's shape, as chat templates take them."""
    if not request.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def template_message(m: ChatMessage, content: str) -> dict[str, Any]:
    """One message as chat templates read it: an assistant's earlier calls carry their
    arguments as a dict (templates write them with `tojson`), as vLLM passes them."""
    msg: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args: Any = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        msg["tool_calls"] = calls
    return msg
