"""A chat reply's text split into what OpenAI's message carries: reasoning, content and tool
calls, for a whole reply or, delta by delta, for a stream.

One parser object per choice: `delta(text, finished)` takes the reply's text so far (only ever
growing) and returns what is new since the last call. A whole reply is one call with
`finished=True`, so streamed and whole replies are the same by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.api_server.protocol import DeltaFunctionCall, DeltaToolCall, random_uuid
from jaxserve.api_server.reasoning_parsers import ReasoningParser
from jaxserve.api_server.tool_parsers import ParsedToolCall, RequiredToolParser, ToolParser


@dataclass(frozen=True)
class ToolMode:
    """How a request's tool_choice reads the reply: "none" (all content), "auto" (the
    server's tool parser finds calls, if any), "required" (the grammar made the reply a list
    of calls) or "named" (the grammar made the reply the arguments of `function`)."""

    choice: str = "none"
    function: str | None = None
    parallel: bool = True
    parser: type[ToolParser] | None = None  # "auto": the --tool-call-parser


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class _SentCall:
    id: str
    arguments: int  # characters of its arguments already sent


class ChatOutputParser:
    def __init__(self, mode: ToolMode, reasoning: type[ReasoningParser] | None = None) -> None:
        self.mode = mode
        self.reasoning = reasoning() if reasoning else None
        parser = RequiredToolParser if mode.choice == "required" else mode.parser
        self.tool_parser = parser() if parser and mode.choice in ("auto", "required") else None
        self.sent_reasoning = self.sent_content = 0
        self.sent_calls: list[_SentCall] = []
        self.has_reasoning = False
        self.reasoning_text = ""  # the reasoning so far (the usage counts its tokens)

    def delta(self, text: str, finished: bool) -> ChatDelta:
        """What of `text` (the reply so far) has not been returned yet."""
        out = ChatDelta()
        content = text
        if self.reasoning is not None:
            split = self.reasoning.split(text, finished)
            if split.reasoning is not None:
                self.has_reasoning = True
                out.reasoning = split.reasoning[self.sent_reasoning:]
                self.reasoning_text = split.reasoning
                self.sent_reasoning = len(split.reasoning)
            content = split.content
        content_end, calls = self._calls(text, content, finished)
        out.content = content[self.sent_content:content_end]
        self.sent_content = max(self.sent_content, content_end)
        for i, call in enumerate(calls):
            if call.name is None or (i > 0 and not self.mode.parallel):
                continue
            if i == len(self.sent_calls):
                self.sent_calls.append(_SentCall(f"chatcmpl-tool-{random_uuid()}", len(call.arguments)))
                out.tool_calls.append(DeltaToolCall(
                    index=i, id=self.sent_calls[i].id, type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > self.sent_calls[i].arguments:
                new = call.arguments[self.sent_calls[i].arguments:]
                self.sent_calls[i].arguments = len(call.arguments)
                out.tool_calls.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
        return out

    def _calls(self, text: str, content: str, finished: bool) -> tuple[int, list[ParsedToolCall]]:
        """How much of `content` is content, and the calls: found in `content` (what the
        reasoning parser left of the reply `text`), or in all of `text` for a parser whose
        calls sit beside the content (harmony: the reasoning parser leaves them out)."""
        if self.mode.choice == "named":
            return 0, [ParsedToolCall(self.mode.function, content, finished)]
        if self.tool_parser is None:
            return len(content), []
        if self.tool_parser.calls_beside_content:
            return len(content), self.tool_parser.parse(text, finished).calls
        parsed = self.tool_parser.parse(content, finished)
        if (finished and parsed.in_calls and self.mode.choice == "auto"
                and not any(c.name is not None for c in parsed.calls)):
            return len(content), []  # it looked like a call but was not one: it is content
        return parsed.content_end, parsed.calls

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model stopped after calling tools on its own
        ("auto", "required"); a named choice stays "stop"."""
        if reason == "stop" and self.sent_calls and self.mode.choice in ("auto", "required"):
            return "tool_calls"
        return reason
