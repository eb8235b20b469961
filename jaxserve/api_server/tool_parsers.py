"""Tool-call parsers (vLLM's `--tool-call-parser`): find the calls in a model's text.

Each model family writes its calls its own way; all of them write a run of JSON objects
`{"name": ..., "arguments": {...}}` after a marker, so one scanner serves them all and a parser
is its marker, its separators and the key holding the arguments:

    hermes / qwen   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>  (repeated)
    llama3_json     {"name": "f", "parameters": {...}}; {...}   (or after <|python_tag|>)
    mistral         [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]

GPT-OSS (`openai`) writes its calls otherwise: each call is a harmony message of its own,
addressed to the tool (`...to=functions.f <|constrain|>json<|message|>{...}<|call|>`), beside the
reasoning and the answer rather than after them; OpenAIToolParser reads them with harmony.py.

The scanner also reads a text that is still growing (a stream): a call whose name is complete
is reported with the arguments' JSON text received so far, so a stream can send the name at
once and the arguments as they arrive. Arguments are kept as the model wrote them (not
re-serialized), so what a stream sent is always a prefix of the final arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jaxserve.api_server.harmony import harmony_messages

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class ParsedToolCall:
    """One call found in the text: `name` None until its name is complete; `arguments` the
    arguments' JSON text so far (the whole of it once `complete`)."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class ParsedToolCalls:
    """`content_end`: how much of the text is plain content (before the calls, or all of it);
    `calls`: the calls after it, the last one possibly incomplete."""

    content_end: int
    calls: list[ParsedToolCall]
    in_calls: bool  # a call region was found (content after content_end is not content)


class ToolParser:
    """Finds calls after `marker` (the text's start when `marker` is ""), separated by
    whitespace and `separators`, their arguments under one of `argument_keys`."""

    name = "base"
    marker = ""
    separators: tuple[str, ...] = ()
    argument_keys: tuple[str, ...] = ("arguments",)
    # The reply must be decoded with its special tokens kept (skip_special_tokens=False): the
    # calls are written with markers the tokenizer holds as special tokens.
    needs_special_tokens = False
    # Where the calls are. False: after the content (in what the reasoning parser leaves, or
    # the whole reply), and `parse` says where the content ends. True: in messages of their
    # own beside the reasoning and the content (harmony): `parse` reads the whole reply, and
    # the content is all that the reasoning parser leaves (which leaves the calls out).
    calls_beside_content = False
    # The --reasoning-parser that reads this parser's format: the one used when none is given,
    # and the only one it works with.
    reasoning_parser: str | None = None

    def region_start(self, text: str) -> tuple[int, int] | None:
        """(content end, first call's search start) if the text has entered its calls."""
        i = text.find(self.marker)
        return None if i < 0 else (i, i + len(self.marker))

    def holdback(self, text: str) -> int:
        """Characters at the end of a growing text that may be the start of the marker."""
        return _partial_suffix(text, self.marker)

    def parse(self, text: str, finished: bool) -> ParsedToolCalls:
        """The content and calls in `text` (finished: the text is final)."""
        region = self.region_start(text)
        if region is None:
            end = len(text) if finished else len(text) - self.holdback(text)
            return ParsedToolCalls(end, [], False)
        content_end, pos = region
        calls = []
        while True:
            pos = self._skip_separators(text, pos)
            if pos >= len(text) or text[pos] != "{":
                break
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                # Still being written, or (finished) cut off or malformed: a call with a name
                # is kept either way, so a stream and a whole reply read the same text alike.
                partial = self._partial_call(text, pos)
                if partial is not None:
                    calls.append(partial)
                break
            call = self._complete_call(text, pos, obj)
            if call is None:
                break
            calls.append(call)
            pos = end
        return ParsedToolCalls(content_end, calls, True)

    def _skip_separators(self, text: str, pos: int) -> int:
        while pos < len(text):
            if text[pos].isspace():
                pos += 1
                continue
            for sep in self.separators:
                if text.startswith(sep, pos):
                    pos += len(sep)
                    break
            else:
                return pos
        return pos

    def _arguments_start(self, text: str, pos: int) -> tuple[str | None, int | None]:
        """The name of the call at `pos` and where its arguments start, when the model wrote
        the name first (as every template shows it)."""
        m = _NAME.match(text, pos)
        if m is None:
            return None, None
        try:
            name = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            return None, None
        keys = "|".join(re.escape(k) for k in self.argument_keys)
        a = re.compile(rf'\s*,\s*"(?:{keys})"\s*:\s*').match(text, m.end())
        return name, (a.end() if a else None)

    def _partial_call(self, text: str, pos: int) -> ParsedToolCall | None:
        name, args_at = self._arguments_start(text, pos)
        if name is None:
            return None
        if args_at is None or args_at >= len(text):
            return ParsedToolCall(name, "", False)
        try:
            _, end = _DECODER.raw_decode(text, args_at)
        except json.JSONDecodeError:
            end = len(text)
        return ParsedToolCall(name, text[args_at:end], False)

    def _complete_call(self, text: str, pos: int, obj: object) -> ParsedToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name, args_at = self._arguments_start(text, pos)
        if args_at is not None:
            _, end = _DECODER.raw_decode(text, args_at)
            return ParsedToolCall(obj["name"], text[args_at:end], True)
        args: object = next((obj[k] for k in self.argument_keys if k in obj), {})
        return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False), True)


class HermesToolParser(ToolParser):
    """Hermes and Qwen2.5/Qwen3: each call in <tool_call>...</tool_call>."""

    name = "hermes"
    marker = "<tool_call>"
    separators = ("</tool_call>", "<tool_call>")


class MistralToolParser(ToolParser):
    """Mistral (v0.3 tokenizer): [TOOL_CALLS] then a JSON list of calls."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    separators = ("[", ",", "]")


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calls: the reply is the call(s), `;`-separated, optionally
    after <|python_tag|>. A reply that starts otherwise is content."""

    name = "llama3_json"
    marker = "<|python_tag|>"
    separators = (";",)
    argument_keys = ("parameters", "arguments")

    def region_start(self, text: str) -> tuple[int, int] | None:
        stripped = len(text) - len(text.lstrip())
        if text.startswith(self.marker, stripped):
            return 0, stripped + len(self.marker)
        if text.startswith("{", stripped):
            return 0, stripped
        return None

    def holdback(self, text: str) -> int:
        # Only the very start can open the calls: hold back while it might.
        stripped = text.lstrip()
        return len(text) if self.marker.startswith(stripped) else 0


class RequiredToolParser(ToolParser):
    """tool_choice "required": the grammar makes the reply a JSON list of
    {"name", "parameters"} objects (the schema `required_tools_schema` builds)."""

    name = "required"
    separators = ("[", ",", "]")
    argument_keys = ("parameters",)

    def region_start(self, text: str) -> tuple[int, int] | None:
        return 0, 0


class OpenAIToolParser(ToolParser):
    """vLLM's `openai`: GPT-OSS's harmony replies, read with the special tokens kept. Each
    message addressed to `functions.NAME` is a call to the request's tool NAME, its body the
    arguments as the model wrote them (JSON, under `<|constrain|>json`). A call is reported
    once its header is complete (the name is settled) and its arguments grow with the body;
    one cut off at the end keeps the arguments written. Messages addressed to other
    recipients (`browser.search`, `python`, `container.exec`) are calls to GPT-OSS's built-in
    tools, which the server would have to run itself and jaxserve does not: they are left out
    of both the calls and the content. The content and reasoning are the openai_gptoss
    reasoning parser's (final and commentary to no one; analysis), which the chat serving
    uses when --reasoning-parser is not given."""

    name = "openai"
    needs_special_tokens = True
    calls_beside_content = True
    reasoning_parser = "openai_gptoss"

    def parse(self, text: str, finished: bool) -> ParsedToolCalls:
        calls = [ParsedToolCall(m.function, m.body, m.ended)
                 for m in harmony_messages(text, finished) if m.function is not None]
        # content_end: the content is the reasoning parser's, not a part of `text`.
        return ParsedToolCalls(len(text), calls, bool(calls))


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen": HermesToolParser, "mistral": MistralToolParser,
    "llama3_json": Llama3JsonToolParser, "openai": OpenAIToolParser,
}


def required_tools_schema(tools: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """The JSON schema that enforces tool_choice "required": a list of calls (one at most
    unless `parallel`), each naming one of `tools` (name, parameters schema) with its
    parameters (vLLM's shape). Each tool's `$defs` move to the root, where its `$ref`
    pointers (`#/$defs/...`, what pydantic writes for nested models) can reach them."""
    defs: dict[str, Any] = {}
    items = []
    for name, params in tools:
        params = hoist_defs(params, defs) if params else {"type": "object"}
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def hoist_defs(schema: dict, defs: dict[str, Any]) -> dict:
    """`schema` without its `$defs` (or `definitions`), which join `defs`; a name another tool
    already defined differently gets a suffix, and the pointers to it follow."""
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    if not own:
        return schema
    renames: dict[str, str] = {}
    for key, body in own.items():
        new, k = key, 1
        while new in defs and defs[new] != body:
            new, k = f"{key}_{k}", k + 1
        renames[key] = new

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix):
                        head, _, rest = ref[len(prefix):].partition("/")
                        if head in renames:
                            out["$ref"] = f"#/$defs/{renames[head]}" + (f"/{rest}" if rest else "")
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for key, body in own.items():
        defs[renames[key]] = rewrite(body)
    return rewrite(schema)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
