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

from dataclasses import dataclass

from jaxserve.api_server.harmony import HarmonyMessage, harmony_messages, has_marker
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


class GptOssReasoningParser(ReasoningParser):
    """vLLM's openai_gptoss: GPT-OSS replies in harmony, a run of messages such as
    `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`
    (harmony.py reads them). vLLM parses the token ids with the openai_harmony library; this
    reads the text decoded with the special tokens kept.

    Reasoning: the analysis messages' text; content: the final messages' and commentary
    without a recipient (a preamble to the user); several messages of one kind are joined by a
    newline. A message with a recipient (`to=functions.get_weather`, `to=python`) is a tool
    call and is in neither part: the openai tool parser reads the calls to the request's tools
    (tool_parsers.py). Text before any header (a model that did not follow the format) is
    content; a reply with no marker at all is all content."""

    name = "openai_gptoss"
    needs_special_tokens = True

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        if finished and not has_marker(text):
            return ReasoningSplit(None, text)
        parts: dict[str, str | None] = {"reasoning": None, "content": None}
        for message in harmony_messages(text, finished):
            part = self._part(message)
            if part is not None:  # a newline parts it from the part's earlier text
                earlier = parts[part]
                parts[part] = (earlier + "\n" if earlier else "") + message.body
        return ReasoningSplit(parts["reasoning"], parts["content"] or "")

    @staticmethod
    def _part(message: HarmonyMessage) -> str | None:
        """Which part a message belongs to (None: neither)."""
        if message.header is None:
            return "content"
        if message.recipient is not None:
            return None
        return "reasoning" if message.channel == "analysis" else "content"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ReasoningParser, "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}
