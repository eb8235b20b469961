"""The Responses API's translation to and from the chat path (no server): input items to chat
messages, chat deltas to the Responses event sequence."""

from __future__ import annotations

import json

import pytest

from jaxserve.api_server.serving import OpenAIError
from jaxserve.api_server.serving_responses import StreamEvents, input_messages, output_items


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                        {"type": "input_text", "text": "there"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
            {"type": "reasoning_text", "text": "call the tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Done.", "annotations": []}]},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "", "reasoning": "call the tool", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "Done."},
    ]
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]
    for bad, words in [([{"type": "item_reference", "id": "x"}], "item_reference"),
                       ([{"role": "tool", "content": "x"}], "role"),
                       ([{"role": "user", "content": [{"type": "input_audio"}]}], "input_audio")]:
        with pytest.raises(OpenAIError, match=words):
            input_messages(bad)


def test_chat_deltas_become_the_responses_event_sequence() -> None:
    ev = StreamEvents()
    deltas = [{"role": "assistant", "content": ""}, {"reasoning": "hmm"}, {"content": "Hel"},
              {"content": "lo"},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}]
    frames = [f for d in deltas for f in ev.delta(d)] + ev.close_all()
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert all(f.startswith(f"event: {e['type']}\n") for f, e in zip(frames, events))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    reasoning, message, call = ev.items
    assert reasoning["content"][0]["text"] == "hmm"
    assert message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "f", '{"a": 1}')
    # The same reply, whole, gives the same items.
    whole = output_items({"reasoning": "hmm", "content": "Hello", "tool_calls": [
        {"id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]})
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
    assert strip(whole) == strip(ev.items)
    assert ev.as_message() == {"content": "Hello", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
