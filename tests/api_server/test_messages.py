"""POST /v1/messages and /v1/messages/count_tokens through the `anthropic` SDK (Claude Code's
protocol): the default model behind `--enable-auto-tool-choice --tool-call-parser hermes`."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import jsonschema
import pytest

from .server_utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
GREEDY = {"temperature": 0.0}  # the current SDK sends sampling fields in extra_body only
# Anthropic's published order of a streamed message's events.
BLOCK_EVENTS = {"content_block_start", "content_block_delta", "content_block_stop", "ping"}


@pytest.fixture(scope="module")
def server(agent_server: RemoteServer) -> RemoteServer:
    return agent_server


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(""), api_key="x", max_retries=0)


def raw_events(server: RemoteServer, body: dict) -> list[tuple[str, dict]]:
    """The stream's (event, data) pairs, pings included (the SDK hides them)."""
    out = []
    with httpx.stream("POST", server.url("/v1/messages"), json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == kind
                out.append((kind, data))
    return out


def assert_published_order(kinds: list[str]) -> None:
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert set(kinds[1:-2]) <= BLOCK_EVENTS
    open_block = False
    for k in kinds[1:-2]:
        if k == "content_block_start":
            assert not open_block
            open_block = True
        elif k in ("content_block_delta", "content_block_stop"):
            assert open_block
            open_block = k == "content_block_delta"
    assert not open_block


def test_whole_and_streamed_agree_and_usage_is_counted(client: anthropic.Anthropic,
                                                       server: RemoteServer) -> None:
    kw = dict(model=MODEL, max_tokens=12, system=[{"type": "text", "text": "Answer briefly."}],
              messages=[{"role": "user", "content": "What is the capital of France?"}])
    whole = client.messages.create(**kw, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.content[0].type == "text" and whole.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model=MODEL, system=kw["system"],
                                           messages=kw["messages"]).input_tokens
    u = whole.usage
    assert u.input_tokens + u.cache_read_input_tokens == counted and u.output_tokens > 0
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == u.output_tokens
    events = raw_events(server, {**kw, **GREEDY})
    kinds = [k for k, _ in events]
    assert_published_order(kinds)
    assert kinds[1] == "ping"
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == counted
    assert delta["usage"]["output_tokens"] == u.output_tokens


def test_max_tokens_beyond_the_context_is_served_to_what_is_left(client: anthropic.Anthropic
                                                                 ) -> None:
    """Anthropic's clients ask for tens of thousands of tokens whatever the context (512)."""
    long = "Repeat after me: " + "the cat sat on the mat. " * 60
    with client.messages.stream(model=MODEL, max_tokens=32000, extra_body=GREEDY,
                                messages=[{"role": "user", "content": long}]) as stream:
        final = stream.get_final_message()
    used = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert used + final.usage.output_tokens <= 512
    assert final.stop_reason in ("max_tokens", "end_turn")


def test_a_tool_round_trip_whole_and_streamed(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=60, tools=[TOOL], messages=ask,
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    second = client.messages.create(
        model=MODEL, max_tokens=30, tools=[TOOL], extra_body=GREEDY, messages=[
            *ask, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
                {"type": "text", "text": "Thanks."}]}])
    assert second.content and second.stop_reason in ("end_turn", "max_tokens")
    # Streamed, the input arrives as input_json_delta, assembled by the SDK.
    with client.messages.stream(model=MODEL, max_tokens=60, tools=[TOOL], messages=ask,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert json.loads(partial) == use.input and final.stop_reason == "tool_use"


def test_claude_codes_extras_are_accepted(server: RemoteServer) -> None:
    """What Claude Code sends beside the Messages fields: beta query and headers, adaptive
    thinking, context management, effort, metadata, a mid-conversation system message, a
    server tool (skipped) and cache_control marks."""
    body = {"model": MODEL, "max_tokens": 4, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
            "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"}],
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "Agents available: none."}]}
    r = httpx.post(server.url("/v1/messages?beta=true"), json=body, timeout=60,
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x-2025"})
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, ["max_tokens"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, ["toolu_nope"]),
    ({"max_tokens": 4, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}}]},
        {"role": "assistant", "content": "y"}]}, ["without tool_result", "t1"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "widget"}]}]},
     ["widget"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, ["image", "text only"]),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "tool", "name": "web_search"},
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ["web_search"]),
    ({"max_tokens": 4, "messages": []}, ["messages"]),
])
def test_bad_bodies_get_anthropics_error_envelope(server: RemoteServer, body: dict,
                                                  words: list[str]) -> None:
    r = httpx.post(server.url("/v1/messages"), json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
    assert all(w in got["error"]["message"] for w in words), got
    r = httpx.post(server.url("/v1/messages"), json={**body, "model": "claude-x", "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_malformed_bodies_leave_a_running_stream_and_health_alone(server: RemoteServer) -> None:
    """200 malformed bodies across the new routes while a stream runs: no 5xx, the stream
    finishes, /health stays green."""
    result: dict = {}

    def stream() -> None:
        # Greedy, this prompt loops until max_tokens: a stream that outlasts the bodies.
        result["events"] = raw_events(server, {
            "model": MODEL, "max_tokens": 200, "temperature": 0.0, "system": "Answer briefly.",
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})

    t = threading.Thread(target=stream)
    t.start()
    bad = [b'{"model": "m"', b"[]", b'{"messages": 3}', b'{"max_tokens": -1, "messages": []}',
           b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1, "messages": [{"role": "bot"}]}',
           b'{"input": {"x": 1}}', b'{"input": [{"type": "function_call", "name": 5}]}',
           b'{"input": "x", "previous_response_id": "resp_none"}', b"\xff\xfe"]
    routes = [("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_none"),
              ("POST", "/v1/responses/resp_none/cancel"), ("DELETE", "/v1/responses/resp_none")]
    with httpx.Client(timeout=60) as http:
        for i in range(200):
            method, path = routes[i % len(routes)]
            r = http.request(method, server.url(path), content=bad[i % len(bad)],
                             headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (method, path, r.text[:300])
        assert http.get(server.url("/health")).status_code == 200
    t.join(120)
    kinds = [k for k, _ in result["events"]]
    assert_published_order(kinds)
    assert result["events"][-2][1]["usage"]["output_tokens"] > 0
