"""The Messages translation without a model: Anthropic messages -> chat messages, and chat
deltas -> Anthropic's stream events (thinking blocks need a reasoning model; these canned
deltas stand in for one)."""

from __future__ import annotations

import json

import pytest

from jaxserve.api_server.messages_protocol import MessageParam
from jaxserve.api_server.serving import OpenAIError
from jaxserve.api_server.serving_messages import (
    MessageEvents,
    content_blocks,
    conversation,
    stop_of,
    usage_of,
)


def parse(frames: list[str]) -> list[dict]:
    out = []
    for frame in frames:
        kind, data = frame.strip().split("\n")
        event = json.loads(data[len("data: "):])
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_messages_become_chat_messages() -> None:
    msgs = [MessageParam(role="user", content="weather?"),
            MessageParam(role="assistant", content=[
                {"type": "thinking", "thinking": "look it up", "signature": "s"},
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Paris"}}]),
            MessageParam(role="user", content=[
                {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "try again"}]),
            MessageParam(role="system", content="Tools may fail.")]
    assert conversation(msgs) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "reasoning": "look it up",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: timeout"},
        {"role": "user", "content": "try again\n\nTools may fail."}]
    with pytest.raises(OpenAIError, match="without tool_result blocks immediately after: t1"):
        conversation([msgs[0], msgs[1], MessageParam(role="user", content="ok")])


def test_the_request_becomes_a_chat_request() -> None:
    from jaxserve.api_server.messages_protocol import MessagesRequest
    from jaxserve.api_server.serving_messages import translate

    chat = translate(MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "stop_sequences": ["END"], "top_k": 5,
        "system": [{"type": "text", "text": "Be brief."}], "thinking": {"type": "disabled"},
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object"}},
                  {"type": "web_search_20250305", "name": "web_search"}],
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]}))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant"]
    assert chat.continue_final_message and not chat.add_generation_prompt  # a prefill
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert [t.function.name for t in chat.tools] == ["f"] and chat.tool_choice == "required"
    assert not chat.parallel_tool_calls and chat.stop == ["END"] and chat.top_k == 5
    assert chat.max_completion_tokens == 9


def test_chat_deltas_become_anthropics_events() -> None:
    ev = MessageEvents()
    frames = [*ev.delta({"reasoning": "hm"}), *ev.delta({"reasoning": "m"}),
              *ev.delta({"content": "Hi"}),
              *ev.delta({"tool_calls": [{"index": 0, "id": "c0",
                                         "function": {"name": "f", "arguments": '{"a"'}}]}),
              *ev.delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
              *ev.delta({"tool_calls": [{"index": 1, "id": "c1",
                                         "function": {"name": "g", "arguments": "{}"}}]}),
              *ev.close()]
    events = parse(frames)
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0),  # thinking, then its signature
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3)]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "signature_delta", "text_delta",
        "input_json_delta", "input_json_delta", "input_json_delta"]
    assert events[8]["content_block"] == {"type": "tool_use", "name": "f", "id": "c0",
                                          "input": {}}
    assert ev.called and stop_of({"finish_reason": "stop"}, None, ev.called)[0] == "tool_use"
    # The same reply, whole.
    blocks = content_blocks({"reasoning": "hmm", "content": "Hi", "tool_calls": [
        {"id": "c0", "function": {"name": "f", "arguments": '{"a": 1}'}}]})
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[2]["input"] == {"a": 1}


def test_stop_reasons_and_usage() -> None:
    assert stop_of({"finish_reason": "stop", "stop_reason": "END"}, ["END"], False) == (
        "stop_sequence", "END")
    assert stop_of({"finish_reason": "stop", "stop_reason": 2}, ["END"], False) == ("end_turn", None)
    assert stop_of({"finish_reason": "length"}, None, True) == ("max_tokens", None)
    assert usage_of({"prompt_tokens": 40, "completion_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": 32}}) == {
        "input_tokens": 8, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32,
        "output_tokens": 3}


def test_a_quiet_stream_gets_keep_alives_and_closes_cleanly() -> None:
    import asyncio
    from contextlib import aclosing

    from jaxserve.api_server.chat_translation import with_heartbeat

    async def slow():
        await asyncio.sleep(0.25)
        yield {"n": 1}
        await asyncio.sleep(10)  # never reached: the reader stops first
        yield {"n": 2}

    async def read() -> list:
        got = []
        async with aclosing(slow()) as events, aclosing(with_heartbeat(events, 0.1)) as beats:
            async for e in beats:
                got.append(e)
                if e is not None:
                    break
        return got

    got = asyncio.run(read())
    assert got[-1] == {"n": 1} and got[:-1] and all(e is None for e in got[:-1])
