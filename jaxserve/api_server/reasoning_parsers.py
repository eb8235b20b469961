"""Reasoning parsers (vLLM's `--reasoning-parser`): split the model's reasoning from the answer.

    deepseek_r1    DeepSeek-R1 and QwQ: the template may already have opened <think> in the
                   prompt, so everything before </think> is reasoning (all of it if the reply
                   never closes it).
    qwen3          Qwen3: reasoning only when the reply opens with <think>; otherwise (thinking
                   turned off) it is all answer.
    openai_gptoss  GPT-OSS's harmony format: the analysis channel's messages are reasoning, the
                   final channel's (and commentary that calls no tool) are the answer.

All read a growing text (a stream): what they return only ever grows, and a possible
half-written tag at the end is held back until it is complete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxserve.api_server.tool_parsers import _partial_suffix


@dataclass
class ReasoningSplit:
    reasoning: str | None  # None: this reply has no reasoning part
    content: str


class ReasoningParser:
    name = "deepseek_r1"
    start, end = "<think>", "</think>"
    reasoning_without_start = True  # deepseek_r1: the prompt may have opened <think>
    # The reply must be decoded with its special tokens kept (skip_special_tokens=False):
    # the parser reads markers that the tokenizer holds as special tokens.
    needs_special_tokens = False

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        """The reasoning and the answer in `text`, as far as they are settled."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not finished and self.start.startswith(body):
            return ReasoningSplit(None, "")  # may still become <think>
        elif not self.reasoning_without_start:
            return ReasoningSplit(None, text)
        i = body.find(self.end)
        if i >= 0:
            # The answer's leading blank lines are the template's, not the model's words.
            return ReasoningSplit(body[:i], body[i + len(self.end):].lstrip())
        held = 0 if finished else _partial_suffix(body, self.end)
        return ReasoningSplit(body[:len(body) - held], "")


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasoning_without_start = False


# Harmony's markers: special tokens of GPT-OSS's tokenizer, read here as text.
_START, _END, _MESSAGE = "<|start|>", "<|end|>", "<|message|>"
_CHANNEL, _CONSTRAIN = "<|channel|>", "<|constrain|>"
# What ends a message: <|return|> and <|call|> are EOS tokens, so they reach the text only
# when decoding did not stop on them; <|endoftext|> is GPT-OSS's other EOS.
_MESSAGE_ENDS = (_END, "<|return|>", "<|call|>", "<|endoftext|>")
_MARKERS = (_START, _MESSAGE, _CHANNEL, _CONSTRAIN, *_MESSAGE_ENDS)
_MARKER = re.compile("|".join(map(re.escape, _MARKERS)))
_CHANNEL_NAME = re.compile(re.escape(_CHANNEL) + r"\s*([^\s<]*)")
_RECIPIENT = "to="  # a header naming a recipient: the message is a tool call


class GptOssReasoningParser(ReasoningParser):
    """vLLM's openai_gptoss: GPT-OSS replies in harmony, a run of messages such as
    `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`
    (the prompt ends with `<|start|>assistant`, which opens the first header). vLLM parses the
    token ids with the openai_harmony library; this reads the text decoded with the special
    tokens kept.

    Reasoning: the analysis messages' text; content: the final messages' and commentary
    without a recipient (a preamble to the user); several messages of one kind are joined by a
    newline. A message with a recipient (`to=functions.get_weather`, `to=python`) is a tool
    call and is in neither part: its arguments are a tool parser's business. Text before any
    header (a model that did not follow the format) is content; a reply with no marker at all
    is all content."""

    name = "openai_gptoss"
    needs_special_tokens = True

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        if finished and _MARKER.search(text) is None:
            return ReasoningSplit(None, text)
        parts: dict[str, str | None] = {"reasoning": None, "content": None}
        pos, state = 0, "open"
        part: str | None = None  # the current message's part (None: left out)
        while True:
            if state == "open":  # between messages: a header, or plain text
                rest = text[pos:].lstrip()
                if not rest:
                    break
                if rest.startswith(_MARKERS) or rest.startswith(_RECIPIENT):
                    pos, state = len(text) - len(rest), "header"
                elif not finished and any(m.startswith(rest) for m in (*_MARKERS, _RECIPIENT)):
                    break  # may still become a header
                else:
                    part, state = self._open(parts, "content"), "body"
            elif state == "header":  # up to <|message|>; held back until it is complete
                m = text.find(_MESSAGE, pos)
                if m < 0:
                    break
                part = self._open(parts, self._part(text[pos:m]))
                pos, state = m + len(_MESSAGE), "body"
            else:
                found = _MARKER.search(text, pos)
                end = len(text) if found is None else found.start()
                if found is None and not finished:
                    end -= max(_partial_suffix(text[pos:], m) for m in _MARKERS)
                if part is not None:
                    parts[part] = (parts[part] or "") + text[pos:end]
                if found is None:
                    break
                marker = found.group()
                if marker in _MESSAGE_ENDS:
                    pos, state = found.end(), "open"
                elif marker in (_START, _CHANNEL):
                    pos, state = end, "header"  # a new message without <|end|> before it
                else:
                    pos = found.end()  # a stray <|message|> or <|constrain|>: dropped
        return ReasoningSplit(parts["reasoning"], parts["content"] or "")

    @staticmethod
    def _part(header: str) -> str | None:
        """Which part a message with this header belongs to (None: neither)."""
        if _RECIPIENT in header:
            return None
        channel = _CHANNEL_NAME.search(header)
        return "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    @staticmethod
    def _open(parts: dict[str, str | None], part: str | None) -> str | None:
        """Start a message in `part`: a newline parts it from the part's earlier text."""
        if part is not None:
            parts[part] = parts[part] + "\n" if parts[part] else ""
        return part


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ReasoningParser, "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}
