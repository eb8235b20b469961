"""Reasoning parsers (vLLM's `--reasoning-parser`): split `<think>...</think>` from the answer.

    deepseek_r1   DeepSeek-R1 and QwQ: the template may already have opened <think> in the
                  prompt, so everything before </think> is reasoning (all of it if the reply
                  never closes it).
    qwen3         Qwen3: reasoning only when the reply opens with <think>; otherwise (thinking
                  turned off) it is all answer.

Both read a growing text (a stream): what they return only ever grows, and a possible
half-written tag at the end is held back until it is complete.
"""

from __future__ import annotations

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


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ReasoningParser, "qwen3": Qwen3ReasoningParser,
}
