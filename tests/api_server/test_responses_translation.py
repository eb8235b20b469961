"""The Responses API's translation to and from the chat path (no server): input items to chat
messages, chat deltas to the Responses event sequence."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from jaxserve.api_server.responses_items import StreamEvents, input_messages, output_items
from jaxserve.api_server.serving import OpenAIError


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
    assert ev.as_message() == {"content": "Hello", "reasoning": "hmm", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}


def test_a_replayed_turn_stays_one_assistant_message() -> None:
    """A client replaying a turn sends its message item, then its function_call items."""
    items = [{"role": "user", "content": "weather?"},
             {"type": "message", "role": "assistant", "content": "Let me look."},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    assert input_messages(items)[1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


class RecordingChat:
    """The chat box's interface (create_chat_completion) over canned replies, recording the
    chat requests the translation made: the Responses-side logic without a model."""

    def __init__(self, reply: Any) -> None:
        self.ctx = SimpleNamespace(model_name="m", responses_store_size=8, tokenizer=None,
                                   check_model=lambda model, generates=False: None)
        self.reply, self.requests = reply, []

    async def create_chat_completion(self, request: Any, **_: Any) -> Any:
        self.requests.append(request)
        return self.reply()


def test_instructions_apply_to_one_request_and_a_failed_stream_ends_failed() -> None:
    from fastapi.responses import Response, StreamingResponse

    from jaxserve.api_server.responses_protocol import ResponsesRequest
    from jaxserve.api_server.serving_responses import OpenAIServingResponses

    whole = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    chat = RecordingChat(lambda: Response(json.dumps(whole)))
    serving = OpenAIServingResponses(chat)  # type: ignore[arg-type]
    first = json.loads(asyncio.run(serving.create_response(ResponsesRequest(
        input="a", instructions="one", store=True))).body)
    asyncio.run(serving.create_response(ResponsesRequest(
        input="b", instructions="two", previous_response_id=first["id"])))
    roles = [(m.role, m.content) for m in chat.requests[1].messages]
    assert roles == [("system", "two"), ("user", "a"), ("assistant", "hi"), ("user", "b")]

    def failing() -> StreamingResponse:
        async def body():
            yield 'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": null}]}\n\n'
            yield ('data: {"choices": [{"delta": {}, "finish_reason": "error", '
                   '"stop_reason": "structured output failed: row limit"}]}\n\n')
            yield 'data: {"error": {"message": "structured output failed: row limit", "code": 400}}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(body())

    serving = OpenAIServingResponses(RecordingChat(failing))  # type: ignore[arg-type]

    async def events() -> list[dict]:
        reply = await serving.create_response(ResponsesRequest(input="a", stream=True))
        return [json.loads(f.split("data: ", 1)[1]) async for f in reply.body_iterator]

    got = asyncio.run(events())
    assert [e["type"] for e in got][-2:] == ["error", "response.failed"]
    assert got[-1]["response"]["error"]["message"] == "structured output failed: row limit"
    (failed,) = serving.store.items.values()  # kept as failed, with no conversation to continue
    assert failed.response["status"] == "failed" and failed.conversation is None
