"""Tool-call and reasoning parsers: whole replies, and streams (every prefix fed in turn) that
must add up to the whole reply."""

from __future__ import annotations

import json

import pytest

from jaxserve.api_server.chat_output import ChatOutputParser, ToolMode
from jaxserve.api_server.reasoning_parsers import REASONING_PARSERS
from jaxserve.api_server.serving_chat import response_message
from jaxserve.api_server.tool_parsers import TOOL_PARSERS


def auto(parser: str) -> ToolMode:
    return ToolMode("auto", parser=TOOL_PARSERS[parser])


def streamed(mode: ToolMode, text: str, reasoning: str | None = None, step: int = 1) -> dict:
    """Feed every `step`-th prefix of `text`, then the whole; add the deltas up."""
    p = ChatOutputParser(mode, REASONING_PARSERS[reasoning] if reasoning else None)
    out: dict = {"reasoning": "", "content": "", "calls": []}
    ends = list(range(step, len(text), step)) + [len(text)]
    for end in ends:
        d = p.delta(text[:end], finished=end == len(text))
        out["reasoning"] += d.reasoning
        out["content"] += d.content
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index == len(out["calls"]) and c.type == "function"
                out["calls"].append({"id": c.id, "name": c.function.name, "arguments": ""})
            out["calls"][c.index]["arguments"] += c.function.arguments or ""
    return out


def whole(mode: ToolMode, text: str, reasoning: str | None = None) -> dict:
    m = response_message(ChatOutputParser(mode, REASONING_PARSERS[reasoning] if reasoning else None),
                         text)
    return {"reasoning": m.reasoning, "content": m.content,
            "calls": [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls]}


def check_stream_matches(mode: ToolMode, text: str, reasoning: str | None = None) -> dict:
    w = whole(mode, text, reasoning)
    for step in (1, 3, 7):
        s = streamed(mode, text, reasoning, step)
        assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"]] == w["calls"]
        assert s["content"] == (w["content"] or "")
        assert s["reasoning"] == (w["reasoning"] or "")
    return w


WEATHER = {"city": "Paris", "unit": "celsius"}


def test_hermes_calls_and_content() -> None:
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    w = check_stream_matches(auto("hermes"), text)
    assert w["content"] == "Let me check."
    assert w["calls"] == [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]
    p = ChatOutputParser(auto("hermes"))
    p.delta(text, True)
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"


def test_hermes_plain_reply_and_partial_marker() -> None:
    text = "The answer is <b>42</b>, no tools <tool needed."
    w = check_stream_matches(auto("hermes"), text)
    assert w == {"reasoning": None, "content": text, "calls": []}
    # A half-written marker is held back until it is settled.
    p = ChatOutputParser(auto("hermes"))
    assert p.delta("Hi <tool_c", False).content == "Hi "
    assert p.delta("Hi <tool_cx", False).content == "<tool_cx"


def test_arguments_stream_as_they_arrive() -> None:
    p = ChatOutputParser(auto("hermes"))
    d = p.delta('<tool_call>{"name": "get_weather", "arguments": {"ci', False)
    assert d.tool_calls[0].function.name == "get_weather"
    assert d.tool_calls[0].function.arguments == '{"ci'
    d = p.delta('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', True)
    assert d.tool_calls[0].id is None and d.tool_calls[0].function.arguments == 'ty": "Rome"}'


def test_llama3_json() -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
            '"celsius"}}; {"name": "get_time", "parameters": {}}')
    w = check_stream_matches(auto("llama3_json"), text)
    assert w["calls"] == [("get_weather", WEATHER), ("get_time", {})] and w["content"] is None
    w = check_stream_matches(auto("llama3_json"), ' {"name": "f", "parameters": {"x": 1}}')
    assert w["calls"] == [("f", {"x": 1})]
    # Text, or something that only looks like a call, stays content.
    assert check_stream_matches(auto("llama3_json"), "Sure: {a}")["content"] == "Sure: {a}"
    w = check_stream_matches(auto("llama3_json"), '{"not": "a call"}')
    assert w == {"reasoning": None, "content": '{"not": "a call"}', "calls": []}


def test_mistral() -> None:
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}, {"arguments": {"tz": "CET"}, "name": "get_time"}]')
    w = check_stream_matches(auto("mistral"), text)
    # The second call names itself last: it is sent whole once complete.
    assert w["calls"] == [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]


def test_required_and_named() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    w = check_stream_matches(ToolMode("required"), text)
    assert w["calls"] == [("get_weather", WEATHER)] and w["content"] is None
    w = check_stream_matches(ToolMode("named", "get_weather"), json.dumps(WEATHER))
    assert w["calls"] == [("get_weather", WEATHER)] and w["content"] is None
    p = ChatOutputParser(ToolMode("named", "get_weather"))
    p.delta(json.dumps(WEATHER), True)
    assert p.finish_reason("stop") == "stop"  # OpenAI's for a forced function


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    mode = ToolMode("auto", parallel=False, parser=TOOL_PARSERS["hermes"])
    assert whole(mode, text)["calls"] == [("a", {})]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning(parser: str) -> None:
    w = check_stream_matches(ToolMode(), "<think>\n2+2 is 4.\n</think>\n\nIt is 4.", parser)
    assert w["reasoning"] == "\n2+2 is 4.\n" and w["content"] == "It is 4."
    # No <think> at all: DeepSeek-R1's template opened it in the prompt; Qwen3 is not thinking.
    w = check_stream_matches(ToolMode(), "2+2 is 4.</think>It is 4.", parser)
    if parser == "deepseek_r1":
        assert (w["reasoning"], w["content"]) == ("2+2 is 4.", "It is 4.")
    else:
        assert (w["reasoning"], w["content"]) == (None, "2+2 is 4.</think>It is 4.")
    # Cut off while thinking: all reasoning.
    assert check_stream_matches(ToolMode(), "<think>hmm, let me", parser)["reasoning"] == "hmm, let me"


def test_reasoning_then_tool_call() -> None:
    text = '<think>I need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    w = check_stream_matches(auto("hermes"), text, "qwen3")
    assert w["reasoning"] == "I need the weather." and w["calls"] == [("get_weather", WEATHER)]


def test_cut_off_or_malformed_calls_read_the_same_streamed_and_whole() -> None:
    for mode, text in ((auto("hermes"), '<tool_call>\n{"name": "f", "arguments": {"city": "Par'),
                       (auto("hermes"), '<tool_call>{"name": "f", "arguments": {"a": 1.5e}}</tool_call>'),
                       (ToolMode("required"), '[{"name": "get_weather", "parameters": {"city": "Pa')):
        m = response_message(ChatOutputParser(mode), text)
        whole_calls = [(c.function.name, c.function.arguments) for c in m.tool_calls]
        assert whole_calls and m.content is None
        for step in (1, 4):
            s = streamed(mode, text, step=step)
            assert [(c["name"], c["arguments"]) for c in s["calls"]] == whole_calls
            assert s["content"] == ""
    # Nothing with a name: content, both ways.
    text = '<tool_call>{"nam'
    assert response_message(ChatOutputParser(auto("hermes")), text).content == text
    assert streamed(auto("hermes"), text)["content"] == text
