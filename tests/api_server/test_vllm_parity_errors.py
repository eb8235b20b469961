"""vLLM's behaviour where clients match it to the letter (issue 75, items 1, 2, 7 and 8): 400
bodies that carry pydantic's error type and name the field; vLLM's fixed sentences (an
unsupported /pooling task, both generation-prompt flags, every bad logit_bias key); /invocations
answering the fields the SDK sees from the routed endpoint; usage objects in vLLM's shape, whole
and streamed.

The rules are checked on the request and response models first (no server); one server (the
default model) then shows each of them through the openai SDK, and httpx where the SDK hides
the raw body.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import ValidationError

from jaxserve.api_server.embedding_protocol import EmbeddingRequest, PoolingRequest
from jaxserve.api_server.protocol import (
    BOTH_GENERATION_PROMPTS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    PromptTokensDetails,
    ResponseMessage,
    UsageInfo,
)
from jaxserve.api_server.route_utils import describe_validation_errors
from jaxserve.api_server.serving import OpenAIError
from jaxserve.api_server.serving_embedding import OpenAIServingEmbedding
from jaxserve.api_server.utility_protocol import TokenizeRequest
from jaxserve.engine.processor import Processor

from .server_utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi!"}]
INT64_MAX = 2**63 - 1
# vLLM's usage keys: a whole response has all five, a streamed final usage chunk only the counts.
WHOLE_USAGE = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
               "completion_tokens_details"}
COUNTS = {"prompt_tokens", "completion_tokens", "total_tokens"}


def refusal(model: type, body: dict[str, Any]) -> tuple[str, str | None]:
    """The 400's (message, param) for `body`, as the app's handler writes them."""
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(json.dumps(body))
    return describe_validation_errors(e.value.errors())


# --- 1. validation errors carry pydantic's type -------------------------------------------


@pytest.mark.parametrize("seed, kind", [(INT64_MAX + 1, "less_than_equal"),
                                        (-INT64_MAX - 2, "greater_than_equal")])
def test_a_seed_beyond_64_bits_names_the_broken_bound(seed: int, kind: str) -> None:
    message, param = refusal(ChatCompletionRequest, {"messages": HI, "seed": seed})
    assert param == "seed" and message.startswith("seed: Input should be")
    assert f"[type={kind}, input_value={seed}, input_type=int]" in message


def test_a_value_outside_a_literal_is_a_literal_error() -> None:
    message, param = refusal(EmbeddingRequest, {"input": "x", "encoding_format": "hex"})
    assert param == "encoding_format"
    assert message == ("encoding_format: Input should be 'float' or 'base64' "
                       "[type=literal_error, input_value='hex', input_type=str]")
    message, param = refusal(CompletionRequest, {"prompt": "x", "response_format": {"type": "x"}})
    assert param == "response_format.type" and "[type=literal_error" in message


def test_every_wrong_field_is_named_once_with_its_type() -> None:
    message, param = refusal(CompletionRequest, {"prompt": [[1, -1]], "n": 0, "stop": 5})
    # One error each: a union's other alternatives (the prompt as text, ...) are not fields.
    assert message.count("prompt") == 1 and "prompt.0.1: " in message
    assert "n: Input should be greater than or equal to 1 [type=greater_than_equal" in message
    assert "stop: Input should be a valid string [type=string_type" in message
    assert param == "n"  # the first broken constraint, in the model's field order
    # A missing field, and input echoed bounded, however large.
    assert refusal(CompletionRequest, {"max_tokens": 1}) == ("prompt: Field required [type=missing]",
                                                             "prompt")
    message, _ = refusal(CompletionRequest, {"prompt": "x", "user": 7 * 10**300})
    assert len(message) < 300 and "[type=string_type" in message


# --- 2. vLLM's fixed sentences ------------------------------------------------------------


def test_both_generation_prompts_are_refused_in_vllms_words() -> None:
    both = {"continue_final_message": True, "add_generation_prompt": True}
    for model, body in ((EmbeddingRequest, {"messages": HI}), (PoolingRequest, {"messages": HI}),
                        (ChatCompletionRequest, {"messages": HI}), (TokenizeRequest, {"messages": HI})):
        assert refusal(model, {**body, **both}) == (BOTH_GENERATION_PROMPTS, None), model
    assert BOTH_GENERATION_PROMPTS == ("Cannot set both `continue_final_message` and "
                                       "`add_generation_prompt` to True.")
    # Either alone is fine (chat's add_generation_prompt defaults to true, as in vLLM).
    ChatCompletionRequest.model_validate({"messages": HI, "continue_final_message": True})


def test_logit_bias_names_every_bad_key() -> None:
    message, param = refusal(CompletionRequest, {"prompt": "x", "logit_bias": {
        "bad1": 50.0, "7": 1.0, "bad2": 20.0}})
    assert param == "logit_bias"
    assert message == ("logit_bias contains key(s) that cannot be converted to integer token "
                       "IDs: ['bad1', 'bad2']")
    message, _ = refusal(CompletionRequest, {"prompt": "x", "logit_bias": {"-1": 1, "-5": 1}})
    assert "token_id(s) [-1, -5] in logit_bias" in message
    # Keys as int() reads them in vLLM, spelled canonically for the sampler.
    ok = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {" 5": 1.0, "007": -1.0}})
    assert ok.logit_bias == {"5": 1.0, "7": -1.0}


def test_pooling_tasks_vllm_knows_parse_and_removed_ones_are_named() -> None:
    for task in ("classify", "token_classify", "plugin", "embed&token_classify"):
        assert PoolingRequest.model_validate({"input": "x", "task": task}).task == task
    assert refusal(PoolingRequest, {"input": "x", "task": "score"}) == (
        "task: `score` task was removed; use `classify` instead.", "task")
    assert "[type=literal_error" in refusal(PoolingRequest, {"input": "x", "task": "nope"})[0]


class _Processor:
    """The processor's task rule without a model: an embedding model (no classifier)."""

    classifier = None
    check_task = Processor.check_task


class _Context:
    processor = _Processor()


@pytest.mark.parametrize("task", ["classify", "token_classify", "plugin"])
def test_a_pooling_task_the_model_does_not_serve(task: str) -> None:
    serving = OpenAIServingEmbedding(_Context())  # type: ignore[arg-type]
    with pytest.raises(OpenAIError) as e:
        serving.check_pooling_task(task)
    assert e.value.message.startswith(
        f"Unsupported task: {task!r} Supported tasks: ('embed', 'token_embed')")
    assert e.value.param == "task" and e.value.status == 400
    serving.check_pooling_task("token_embed")


# --- 7 and 8. response fields and usage, on the models -----------------------------------


def test_whole_responses_carry_openais_fields_and_vllms_usage() -> None:
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    chat = json.loads(ChatCompletionResponse(id="c", model="m", usage=usage, choices=[
        ChatCompletionResponseChoice(index=0, message=ResponseMessage(content="hi"))]
    ).model_dump_json())
    for key in ("metadata", "moderation", "service_tier", "system_fingerprint"):
        assert key in chat and chat[key] is None
    message = chat["choices"][0]["message"]
    assert {"refusal", "annotations", "audio", "function_call"} <= set(message)
    assert message["tool_calls"] == []
    assert chat["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    cached = usage.model_copy(update={"prompt_tokens_details": PromptTokensDetails(cached_tokens=1)})
    text = json.loads(CompletionResponse(id="t", model="m", usage=cached, choices=[]).model_dump_json())
    assert text["system_fingerprint"] is None and set(text["usage"]) == WHOLE_USAGE
    assert text["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 1, "created_cache_tokens": None, "multimodal_tokens": None}


def test_stream_chunks_carry_usage_in_vllms_shapes() -> None:
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    delta = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content="a"))
    text = CompletionResponseChoice(index=0, text="a")

    def dump(chunk: Any, **kw: Any) -> dict[str, Any]:
        return json.loads(chunk.model_dump_json(**kw))

    chat = dict(id="c", created=1, model="m")
    # No usage: absent, not null (vLLM's exclude_unset), and the caller's exclude still holds.
    assert "usage" not in dump(ChatCompletionStreamResponse(**chat, choices=[delta]))
    assert "usage" not in dump(CompletionStreamResponse(**chat, choices=[text], usage=usage),
                               exclude={"usage"})
    # continuous_usage_stats: the counts; chat's also completion_tokens_details, null.
    assert dump(ChatCompletionStreamResponse(**chat, choices=[delta], usage=usage))["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
        "completion_tokens_details": None}
    assert dump(CompletionStreamResponse(**chat, choices=[text], usage=usage))["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    # The final usage chunk: nothing null anywhere (vLLM's exclude_none).
    final = dump(ChatCompletionStreamResponse(**chat, choices=[], usage=usage.model_copy(
        update={"prompt_tokens_details": PromptTokensDetails(cached_tokens=0)})))
    assert final == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 5,
                                              "completion_tokens": 2,
                                              "prompt_tokens_details": {"cached_tokens": 0}}}


# --- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(agent_server: RemoteServer) -> RemoteServer:
    """The session's shared server (tests/api_server/conftest.py): no start of its own."""
    return agent_server


def post(server: RemoteServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=120)


def sse(server: RemoteServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.slow
def test_errors_through_the_sdk(server: RemoteServer) -> None:
    client = server.client()
    for seed in (-INT64_MAX - 2, INT64_MAX + 1):  # vLLM's test_long_seed
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=HI, temperature=0, seed=seed)
        assert "greater_than_equal" in e.value.message or "less_than_equal" in e.value.message
        assert e.value.body["param"] == "seed" and "seed: " in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="literal_error") as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                       response_format={"type": "yaml"})  # type: ignore[arg-type]
    assert e.value.body["type"] == "BadRequestError" and e.value.body["code"] == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                       logit_bias={"bad1": 50, "bad2": 20})  # type: ignore[dict-item]
    assert "bad1" in e.value.message and "bad2" in e.value.message and "logit_bias" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="x", extra_body={
            "messages": HI, "continue_final_message": True, "add_generation_prompt": True})
    assert e.value.body["message"] == BOTH_GENERATION_PROMPTS
    for task in ("classify", "token_classify", "plugin"):  # vLLM's test_pooling_not_supported
        err = post(server, "/pooling", {"model": MODEL, "input": "x", "encoding_format": "float",
                                        "task": task}).json()["error"]
        assert err["type"] == "BadRequestError" and err["param"] == "task"
        assert err["message"].startswith(f"Unsupported task: {task!r}")


@pytest.mark.slow
def test_invocations_answer_what_the_sdk_sees_from_the_routed_endpoint(server: RemoteServer) -> None:
    """vLLM's test_invocations: the SDK's object of the routed endpoint, dumped, has exactly the
    keys of /invocations' raw body, and the same choices."""
    client = server.client()
    chat_args = {"model": MODEL, "messages": HI, "max_completion_tokens": 5, "temperature": 0.0,
                 "logprobs": False}
    sdk = client.chat.completions.create(**chat_args).model_dump()
    raw = post(server, "/invocations", chat_args).json()
    assert sdk.keys() == raw.keys() and sdk["choices"] == raw["choices"]
    text_args = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
                 "temperature": 0.0}
    sdk = client.completions.create(**text_args).model_dump()
    raw = post(server, "/invocations", text_args).json()
    assert sdk.keys() == raw.keys() and sdk["choices"] == raw["choices"]
    embed_args = {"model": MODEL, "input": ["The chef prepared a meal."], "encoding_format": "float"}
    sdk = client.embeddings.create(**embed_args).model_dump()
    raw = post(server, "/invocations", embed_args).json()
    assert sdk.keys() == raw.keys() and sdk["data"][0].keys() == raw["data"][0].keys()
    rerank_args = {"query": "capital of France?", "documents": ["Paris is.", "Rome is."]}
    assert (post(server, "/rerank", rerank_args).json().keys()
            == post(server, "/invocations", rerank_args).json().keys())


@pytest.mark.slow
def test_usage_objects_in_vllms_shape(server: RemoteServer) -> None:
    chat = {"model": MODEL, "messages": HI, "max_tokens": 3}
    text = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        usage = post(server, path, body).json()["usage"]
        assert set(usage) == WHOLE_USAGE, usage
        assert usage["prompt_tokens_details"] is None and usage["completion_tokens_details"] is None
        # include_usage: the counts on the last chunk only, no nulls; no "usage" elsewhere.
        *chunks, last = sse(server, path, {**body, "stream_options": {"include_usage": True}})
        assert not any("usage" in c for c in chunks) and last["choices"] == []
        assert set(last["usage"]) == COUNTS and last["usage"]["total_tokens"] == usage["total_tokens"]
        # continuous_usage_stats: every chunk's counts (chat's with completion_tokens_details).
        *chunks, last = sse(server, path, {**body, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        want = COUNTS | ({"completion_tokens_details"} if "messages" in body else set())
        assert all(set(c["usage"]) == want for c in chunks), chunks
        assert set(last["usage"]) == COUNTS
    # Through the SDK, the same stream reads as OpenAI's: usage on the last chunk only.
    stream = list(server.client().chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert stream[-1].usage is not None and all(c.usage is None for c in stream[:-1])
    n = stream[-1].usage.prompt_tokens
    assert stream[-1].usage.total_tokens == n + stream[-1].usage.completion_tokens
    # Pooling: the prompt's tokens, completion 0, details null; rerank's: two counts.
    usage = post(server, "/v1/embeddings", {"model": MODEL, "input": "Hello"}).json()["usage"]
    assert usage == {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["prompt_tokens"],
                     "completion_tokens": 0, "prompt_tokens_details": None,
                     "completion_tokens_details": None}
    rerank = post(server, "/rerank", {"query": "q", "documents": ["d"]}).json()
    assert set(rerank["usage"]) == {"prompt_tokens", "total_tokens"}
    assert rerank["results"][0]["document"] == {"text": "d", "multi_modal": None}
