"""GPT-OSS's harmony format read as text (the reply decoded with its special tokens kept): the
messages of a reply, for the openai_gptoss reasoning parser (reasoning_parsers.py) and the
openai tool-call parser (tool_parsers.py).

A harmony reply is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>We need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the prompt ends with `<|start|>assistant`, which opens the first header). The header names the
channel (analysis, commentary, final) and may name a recipient (`to=functions.get_weather`: a
tool call; it may also stand in the role's part, `<|start|>assistant to=functions.f<|channel|>`)
and the body's type (`<|constrain|>json`, or a bare `json`). vLLM reads the token ids with the
openai_harmony library; this reads their text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Harmony's markers: special tokens of GPT-OSS's tokenizer, read here as text.
START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
# What ends a message: <|return|> and <|call|> are EOS tokens, so they reach the text only
# when decoding did not stop on them; <|endoftext|> is GPT-OSS's other EOS.
MESSAGE_ENDS = (END, "<|return|>", "<|call|>", "<|endoftext|>")
MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *MESSAGE_ENDS)
MARKER = re.compile("|".join(map(re.escape, MARKERS)))
RECIPIENT = "to="  # a header naming a recipient: the message is addressed to a tool
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")
_RECIPIENT_NAME = re.compile(re.escape(RECIPIENT) + r"([^\s<]*)")
FUNCTIONS = "functions."  # the namespace of the request's tools


@dataclass
class HarmonyMessage:
    """One message: `header` the text from its start to <|message|> (None: text outside the
    format, before any header), `body` its text so far (a possible half-written marker at the
    end held back until settled), `ended` whether a marker has closed it."""

    header: str | None
    body: str = ""
    ended: bool = False

    @property
    def channel(self) -> str | None:
        m = _CHANNEL_NAME.search(self.header or "")
        return None if m is None else m.group(1)

    @property
    def recipient(self) -> str | None:
        """Whom the message is addressed to (`functions.get_weather`, `python`); None: the
        user."""
        m = _RECIPIENT_NAME.search(self.header or "")
        return None if m is None else m.group(1)

    @property
    def function(self) -> str | None:
        """The name of the request's tool this message calls (`to=functions.NAME`)."""
        r = self.recipient
        return r[len(FUNCTIONS):] if r and r.startswith(FUNCTIONS) and r != FUNCTIONS else None


def has_marker(text: str) -> bool:
    return MARKER.search(text) is not None


def harmony_messages(text: str, finished: bool) -> list[HarmonyMessage]:
    """The messages in `text` (finished: the text is final), in order. What it returns for a
    growing text only grows: a message appears once its header is complete, and its body only
    lengthens. A stray <|message|> or <|constrain|> inside a body is dropped; <|start|> or
    <|channel|> there opens the next message (an <|end|> left out)."""
    messages: list[HarmonyMessage] = []
    pos, state = 0, "open"
    while True:
        if state == "open":  # between messages: a header, or plain text
            rest = text[pos:].lstrip()
            if not rest:
                break
            if rest.startswith(MARKERS) or rest.startswith(RECIPIENT):
                pos, state = len(text) - len(rest), "header"
            elif not finished and any(m.startswith(rest) for m in (*MARKERS, RECIPIENT)):
                break  # may still become a header
            else:
                messages.append(HarmonyMessage(None))
                state = "body"
        elif state == "header":  # up to <|message|>; held back until it is complete
            m = text.find(MESSAGE, pos)
            if m < 0:
                break
            messages.append(HarmonyMessage(text[pos:m]))
            pos, state = m + len(MESSAGE), "body"
        else:
            found = MARKER.search(text, pos)
            end = len(text) if found is None else found.start()
            if found is None and not finished:
                end -= _held_back(text[pos:])
            messages[-1].body += text[pos:end]
            if found is None:
                break
            marker = found.group()
            if marker in MESSAGE_ENDS:
                messages[-1].ended = True
                pos, state = found.end(), "open"
            elif marker in (START, CHANNEL):
                messages[-1].ended = True
                pos, state = end, "header"
            else:
                pos = found.end()
    return messages


def _held_back(text: str) -> int:
    """Characters at the end of `text` (which holds no whole marker) that may start one."""
    for n in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0
