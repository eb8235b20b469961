"""POST /v1/responses through the openai SDK and the OpenAI Agents SDK's default model: the
default model behind `--enable-auto-tool-choice --tool-call-parser hermes`."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest

from .server_utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER}


@pytest.fixture(scope="module")
def server(agent_server: RemoteServer) -> RemoteServer:
    return agent_server


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def test_create_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, instructions="Answer briefly.", input="What is the capital of France?",
              max_output_tokens=16, temperature=0.0)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[-1].type == "message"
    assert whole.usage.output_tokens > 0 and whole.usage.total_tokens == (
        whole.usage.input_tokens + whole.usage.output_tokens)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert {"response.output_item.added", "response.content_part.added",
            "response.output_text.done", "response.output_item.done"} <= set(kinds)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    # A chat-style list of messages is the same conversation as instructions + a string.
    listed = client.responses.create(model=MODEL, max_output_tokens=16, temperature=0.0, input=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    assert listed.output_text == whole.output_text


def test_a_function_tool_and_its_output_with_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[TOOL], tool_choice="required", temperature=0.0,
                                    max_output_tokens=60, store=True)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[TOOL], temperature=0.0,
        max_output_tokens=30, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "sunny, 21 C"}])
    assert second.output_text and second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    # Streamed, the call's arguments arrive as deltas.
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[TOOL],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0.0, max_output_tokens=60, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments and json.loads(args)["city"]


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["answer"],
              "properties": {"answer": {"type": "string", "maxLength": 20}}}
    # Room for the longest document the schema allows: 20 characters of up to four byte
    # tokens each (a sampled run of emoji took 60 tokens before the string could close).
    r = client.responses.create(model=MODEL, input="Capital of Italy, as JSON.", temperature=1.0,
                                max_output_tokens=120, text={"format": {
                                    "type": "json_schema", "name": "a", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", ["input_image"]),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content", ["input_file"]),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice", ["web_search"]),
    ({"input": "x", "background": True, "store": False}, "background", ["store"]),
    ({"input": "x", "background": True, "stream": True}, "stream", ["background"]),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", ["file_search"]),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format", ["yaml"]),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ["greater than"]),
])
def test_unsupported_items_and_tools_are_400s(server: RemoteServer, body: dict, param: str,
                                              words: list[str]) -> None:
    r = httpx.post(server.url("/v1/responses"), json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_store_get_delete_evict_and_usage(client: openai.OpenAI) -> None:
    """store defaults to true; the server keeps the last --responses-store-size (4 here)."""
    kw = dict(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0.0,
              include=["reasoning.encrypted_content"], prompt_cache_key="k",
              extra_body={"client_metadata": {"a": "b"}})
    first = client.responses.create(**kw)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    again = client.responses.create(**kw)  # the same prompt: the prefix cache serves it
    assert again.usage.input_tokens == first.usage.input_tokens
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    assert again.usage.output_tokens_details.reasoning_tokens == 0
    client.responses.delete(again.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)
    later = [client.responses.create(**kw).id for _ in range(4)]
    with pytest.raises(openai.NotFoundError):  # evicted: the oldest goes first
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(later[0]).id == later[0]
    unstored = client.responses.create(**{**kw, "store": False})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_background_polled_and_cancelled(client: openai.OpenAI) -> None:
    done = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8,
                                   background=True)
    assert done.status == "queued" and done.background
    for _ in range(600):
        polled = client.responses.retrieve(done.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert polled.status in ("completed", "incomplete") and polled.usage.output_tokens > 0
    # A long one, cancelled while it runs; its conversation cannot be continued.
    running = client.responses.create(model=MODEL, input="Count to a thousand.",
                                      max_output_tokens=400, background=True,
                                      extra_body={"ignore_eos": True})
    time.sleep(1.0)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="has not completed"):
        client.responses.create(model=MODEL, input="x", previous_response_id=running.id)
    gone = client.responses.create(model=MODEL, input="Count to a thousand.",
                                   max_output_tokens=400, background=True)
    client.responses.delete(gone.id)  # deleting a running one stops it, and it stays gone
    time.sleep(0.5)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError, match="only background"):
        client.responses.cancel(client.responses.create(model=MODEL, input="x",
                                                        max_output_tokens=1).id)


def test_output_text_logprobs(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0.0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**kw)
    lps = whole.output[-1].content[0].logprobs
    assert len(lps) == whole.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps).startswith(whole.output_text)
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in lps][
        :len(streamed)] and streamed
    plain = client.responses.create(**{**kw, "include": None, "top_logprobs": None})
    assert plain.output[-1].content[0].logprobs == []


def test_codex_tools_namespace_and_hosted(client: openai.OpenAI) -> None:
    """Codex's tools: a namespace of functions (a call names its namespace) and a hosted
    web_search (skipped: the server cannot search)."""
    ns = {"type": "namespace", "name": "weather_v1", "description": "Weather tools",
          "tools": [{**TOOL, "strict": False}]}
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=[ns, {"type": "web_search", "external_web_access": False}],
                                tool_choice="required", temperature=0.0, max_output_tokens=60,
                                reasoning={"summary": "auto"})
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert (call.namespace, call.name) == ("weather_v1", "get_weather")
    follow = client.responses.create(
        model=MODEL, tools=[ns], temperature=0.0, max_output_tokens=20, input=[
            {"type": "message", "role": "developer", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "namespace": call.namespace, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_the_agents_sdk_default_model_runs_a_function_tool(server: RemoteServer) -> None:
    """The OpenAI Agents SDK's default model (OpenAIResponsesModel) runs an agent whose first
    turn must call the tool; the SDK runs it and sends its output back for the final answer."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}, 21 C"

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="x")
        agent = Agent(name="weather", instructions="Use the tool, then answer in one sentence.",
                      tools=[get_weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0.0,
                                                   max_tokens=60))
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        return str(result.final_output)

    final = asyncio.run(run())
    assert calls and final
