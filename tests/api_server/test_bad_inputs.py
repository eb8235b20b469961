"""What a careless client or an attacker sends, against the real server (with an API key):
every bad-input case of scripts/attack_server.py gets its 4xx in OpenAI's shape and the
server keeps serving; heavy requests do not freeze /health; failing requests do not grow
the API server's memory; an abort storm leaves no page or counter behind; schemathesis
finds no server error; the API key guards /v1 and the model's path stays private."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import time
from typing import Any

import httpx
import hypothesis
import openai
import pytest
import schemathesis

from .server_utils import EAGER, ROOT, SMALL_ENGINE_ARGS, RemoteServer, wait_idle

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "attack_server", os.path.join(ROOT, "scripts", "attack_server.py"))
attack = sys.modules.setdefault("attack_server", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(attack)

KEY = "test-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
# --chat-template replaces the tokenizer's (the SmolLM2 template, with a visible marker).
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n[[{{ m['content'] }}]]<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server():
    with RemoteServer([*SMALL_ENGINE_ARGS, *EAGER, "--api-key", KEY, "--max-logprobs", "5",
                       "--root-path", "/proxy", "--chat-template", TEMPLATE,
                       "--enable-prompt-tokens-details"], api_key=KEY) as s:
        yield s


@pytest.mark.parametrize("case", attack.CASES, ids=[f"{c.kind}: {c.name}" for c in attack.CASES])
def test_bad_input_is_refused_in_openais_shape(server: RemoteServer, case: Any) -> None:
    r = httpx.post(server.url(case.path), content=case.content(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == case.expect, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == case.expect
    assert "Traceback" not in err["message"] and len(err["message"]) < 2000
    assert httpx.get(server.url("/health"), timeout=5).status_code == 200


def test_field_errors_name_the_field(server: RemoteServer) -> None:
    for body, param in [({"prompt": "x", "top_k": 2**31}, "top_k"),
                        ({"prompt": "x", "seed": 2**64}, "seed"),
                        ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids.0"),
                        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
                        ({"prompt": "a\ud800b"}, "prompt"),
                        ({"prompt": "x", "top_k": 10**6}, "top_k")]:
        r = httpx.post(server.url("/v1/completions"), content=json.dumps(body), timeout=30,
                       headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_heavy_requests_do_not_freeze_health(server: RemoteServer) -> None:
    heavy = [c for c in attack.CASES if c.name in attack.HEAVY] * 2

    async def main() -> tuple[list[int], float]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client, \
                httpx.AsyncClient(timeout=5) as probe:
            work = asyncio.ensure_future(asyncio.gather(
                *(attack.send(client, server.base_url, c) for c in heavy)))
            worst = 0.0
            while not work.done():
                t = time.perf_counter()
                # A freeze shows as a ReadTimeout here (5 s, well past the 1 s target; the
                # figure itself is reported by scripts/attack_server.py, not asserted).
                assert (await probe.get(server.url("/health"))).status_code == 200
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.05)
            return await work, worst

    statuses, worst = asyncio.run(main())
    assert statuses == [c.expect for c in heavy]
    print(f"/health worst latency while heavy requests were refused: {worst * 1e3:.0f} ms")
    ok = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=60,
                    json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def _rss_mib(pid: int) -> float:
    return attack.rss_kib(pid) / 1024


def test_failing_requests_do_not_grow_memory(server: RemoteServer) -> None:
    bad = [c for c in attack.CASES if c.name not in attack.HEAVY]

    async def send(n: int) -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            for i in range(n):
                await attack.send(client, server.base_url, bad[i % len(bad)])

    asyncio.run(send(100))  # warm: caches, pools and lazily imported paths settle first
    before = _rss_mib(server.proc.pid)
    asyncio.run(send(400))
    after = _rss_mib(server.proc.pid)
    # Before the fix, out-of-range ints leaked ~95 MB per 300 requests.
    assert after - before < 25, (before, after)
    wait_idle(server)


def test_abort_storm_returns_pages_and_counters_to_zero(server: RemoteServer) -> None:
    greedy = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16,
              "temperature": 0}
    reference = httpx.post(server.url("/v1/completions"), json=greedy, headers=AUTH,
                           timeout=60).json()["choices"][0]["text"]
    body = {"prompt": "Once upon a time " * 20, "max_tokens": 400, "ignore_eos": True,
            "stream": True}

    async def stream(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", server.url("/v1/completions"), json=body) as r:
            async for _ in r.aiter_lines():
                pass

    async def storm() -> None:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            tasks = [asyncio.ensure_future(stream(client)) for _ in range(100)]
            deadline = time.monotonic() + 60
            # Cancel once the engine is full: some requests running, the rest waiting.
            while True:
                m = await asyncio.to_thread(server.metrics)
                if m["vllm:num_requests_running"] >= 16 and m["vllm:num_requests_waiting"]:
                    break
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    for _ in range(3):
        asyncio.run(storm())
        m = wait_idle(server)
        assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    again = httpx.post(server.url("/v1/completions"), json=greedy, headers=AUTH,
                       timeout=60).json()["choices"][0]["text"]
    assert again == reference


def test_api_key_guards_v1_and_pooling(server: RemoteServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url("/v1/models"), headers=headers, timeout=10)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "AuthenticationError"
    for path in ("/v1/completions", "/v1/embeddings", "/pooling"):  # /pooling runs the model too
        assert httpx.post(server.url(path), json={"input": "x"}, timeout=10).status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url(path), timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    # Anthropic's clients send x-api-key, and read Anthropic's error envelope.
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url("/v1/messages"), json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    r = httpx.post(server.url("/v1/messages"), json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 1, r.text


def test_cors_preflight_passes_before_the_key_check(server: RemoteServer) -> None:
    r = httpx.options(server.url("/v1/chat/completions"), timeout=10, headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_unknown_fields_are_ignored_with_a_warning(server: RemoteServer) -> None:
    r = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=60,
                   json={"prompt": "Hi", "max_tokens": 2, "frobnicate_level": 3})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while "ignored unknown fields 'frobnicate_level'" not in server.read_log():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_server_flags_chat_template_max_logprobs_root_path(server: RemoteServer) -> None:
    r = httpx.post(server.url("/tokenize"), timeout=10, json={
        "messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True})
    assert "[[" in "".join(r.json()["token_strs"])  # rendered with --chat-template
    r = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=30,
                   json={"prompt": "x", "logprobs": 6})
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
    ok = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=30,
                    json={"prompt": "x", "logprobs": 5, "max_tokens": 2})
    assert ok.status_code == 200
    assert httpx.get(server.url("/openapi.json"), timeout=10).json()["servers"] == [{"url": "/proxy"}]


def test_enable_prompt_tokens_details(server: RemoteServer) -> None:
    """vLLM's flag: usage says how many prompt tokens the prefix cache served."""
    client = server.client()
    prompt = "The prefix cache keeps pages of 16 tokens: " * 3
    for _ in range(2):
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert 0 < c.usage.prompt_tokens_details.cached_tokens < c.usage.prompt_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    msgs = [{"role": "user", "content": prompt}]
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert 0 < r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_models_show_the_served_name_not_the_path(server: RemoteServer) -> None:
    r = httpx.get(server.url("/v1/models"), headers=AUTH, timeout=10)
    card = r.json()["data"][0]
    assert card["id"] == card["root"] == MODEL
    assert "/" not in json.dumps(r.json()).replace("/v1", "")


def test_request_chat_template_needs_trust(server: RemoteServer) -> None:
    r = httpx.post(server.url("/v1/chat/completions"), headers=AUTH, timeout=30, json={
        "messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 'x' }}"})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]


# --- schemathesis over /openapi.json ------------------------------------------------------

def _schemathesis_case_ok(case: Any) -> None:
    if isinstance(case.body, dict) and case.path.startswith("/v1/"):
        # Keep generation short: the point is validation, not decoding 500 tokens per example.
        fields = [f for f in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                  if f in case.body]
        for field in fields or ["max_tokens"]:
            if not isinstance(case.body.get(field), int) or case.body[field] > 4:
                case.body[field] = 4
    response = case.call(headers=AUTH, timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])


def test_schemathesis_finds_no_server_error(server: RemoteServer, subtests: Any) -> None:
    """Every operation of /openapi.json, 20 generated cases each.

    NOTE: schemathesis' own pytest plugin (`schemathesis.pytest.from_fixture`) reads pytest
    internals that pytest 9.2 removed; its Python API and Hypothesis' `given` do not depend on
    pytest at all, and a subtest per operation keeps the report per operation."""
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert operations, "the OpenAPI schema lists no operation"
    for operation in operations:
        with subtests.test(msg=f"{operation.method.upper()} {operation.path}"):
            check = hypothesis.settings(
                max_examples=20, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(hypothesis.HealthCheck),
            )(hypothesis.given(case=operation.as_strategy())(_schemathesis_case_ok))
            check()
