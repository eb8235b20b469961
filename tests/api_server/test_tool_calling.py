"""End-to-end tool calling and reasoning through the openai client: the default model behind
`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser deepseek_r1`."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from .server_utils import EAGER, SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}},
        "required": ["tz"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(model=MODEL, temperature=0.0, max_tokens=80)


@pytest.fixture(scope="module")
def server():
    with RemoteServer([*SMALL_ENGINE_ARGS, *EAGER, "--enable-auto-tool-choice", "--tool-call-parser",
                       "hermes", "--reasoning-parser", "deepseek_r1"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def assemble(chunks) -> tuple[list[dict], str, str | None]:
    """Tool calls, content and finish reason added up from a stream's deltas."""
    calls: list[dict] = []
    content, finish = "", None
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return calls, content, finish


def test_a_required_tool_call_returns_valid_arguments(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    # Streamed: the same calls, delta by delta.
    calls, content, finish = assemble(client.chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="required", stream=True, **GREEDY))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert content == "" and finish == "tool_calls"


def test_tool_schemas_with_defs(client: openai.OpenAI) -> None:
    """Parameters as pydantic writes a nested model: `$ref` into `$defs`. Two tools define
    `Opts` differently; "required" and a named choice both follow the pointers."""
    def tool(name: str, opts: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "required": ["city", "opts"], "additionalProperties": False,
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "opts": {"$ref": "#/$defs/Opts"}},
            "$defs": {"Opts": opts}}}}
    units = {"type": "object", "required": ["unit"], "additionalProperties": False,
             "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
    days = {"type": "object", "required": ["days"], "additionalProperties": False,
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    tools = [tool("weather", units), tool("forecast", days)]
    for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
        r = client.chat.completions.create(messages=ASK, tools=tools, tool_choice=choice, **GREEDY)
        for call in r.choices[0].message.tool_calls:
            params = next(t for t in tools if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), params["function"]["parameters"])


def test_named_tool_choice_streams_its_arguments(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 stream=True, **GREEDY))
    calls, content, finish = assemble(chunks)
    assert [c["name"] for c in calls] == ["get_time"] and finish == "stop"
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS["get_time"])
    # The arguments arrive over several deltas, not in one piece at the end.
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls) > 2
    whole = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY)
    assert whole.choices[0].message.tool_calls[0].function.arguments == calls[0]["arguments"]


def test_auto_tool_choice_parses_hermes_calls(client: openai.OpenAI) -> None:
    # The model is too small to call tools by itself: a regex makes it write a Hermes call.
    forced = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Lyon)", "unit": "celsius"\}\}\n</tool_call>')
    kw = dict(messages=ASK, tools=TOOLS, extra_body={"structured_outputs": {"regex": forced}}, **GREEDY)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking.\n"
    [call] = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] == "celsius"
    calls, content, finish = assemble(client.chat.completions.create(stream=True, **kw))
    assert content == "Checking.\n" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_tool_choice_none_and_a_tool_conversation(client: openai.OpenAI) -> None:
    conversation = [*ASK,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {
                            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(messages=conversation, tools=TOOLS, tool_choice="none",
                                       **{**GREEDY, "max_tokens": 8})
    assert r.choices[0].message.tool_calls in (None, [])
    assert r.choices[0].finish_reason == "length"


def test_reasoning_parser_splits_the_reply(server: RemoteServer, client: openai.OpenAI) -> None:
    # deepseek_r1 reads everything before </think> as reasoning (its template opens <think> in
    # the prompt); this model never closes it, so the whole reply is reasoning.
    kw = dict(messages=ASK, model=MODEL, temperature=0.0, max_tokens=16)
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.reasoning and msg.model_extra["reasoning_content"] == msg.reasoning
    assert not msg.content
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(ch.choices[0].delta.model_extra.get("reasoning") or ""
                       for ch in chunks if ch.choices)
    assert streamed == msg.reasoning
    # vLLM's usage with a reasoning parser: the reasoning text's tokens, whole and streamed.
    tokens = httpx.post(server.url("/tokenize"), timeout=60, json={
        "model": MODEL, "prompt": msg.reasoning, "add_special_tokens": False}).json()["count"]
    assert 0 < tokens <= whole.usage.completion_tokens
    assert whole.usage.completion_tokens_details.reasoning_tokens == tokens
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == tokens


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_tool_requests_are_400s(server: RemoteServer, body: dict, param: str) -> None:
    r = httpx.post(server.url("/v1/chat/completions"), json={"messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_prompt_logprobs(server: RemoteServer) -> None:
    n_prompt = httpx.post(server.url("/tokenize"), json={"messages": ASK}, timeout=10).json()["count"]
    body = {"messages": ASK, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).json()
    plp = r["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    assert all(1 <= len(e) <= 2 and all("logprob" in v for v in e.values()) for e in plp[1:])
    r = httpx.post(server.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
