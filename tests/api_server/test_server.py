"""End-to-end: the real server (default model) in a subprocess, driven by the `openai` client.

One server for the whole module (started once, ~15 s); the greedy-equality
test also builds an in-process `LLM` with the same engine settings.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from .server_utils import EAGER, SMALL_ENGINE_ARGS, RemoteServer, ipc_files, process_gone, wait_idle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
]
HI = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ipc"))
    with RemoteServer([*SMALL_ENGINE_ARGS, *EAGER], env={"TMPDIR": tmp}) as s:
        assert ipc_files(tmp)
        yield s
    # `with` ended it with SIGTERM (docker stop): a clean exit through the same cleanup as
    # Ctrl-C (test_engine_death.py), its IPC files gone.
    assert s.proc.returncode == 0, s.read_log()[-3000:]
    assert not ipc_files(tmp)
    assert process_gone(s.engine_pid())


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


# --- basics -----------------------------------------------------------------------------


def test_models_version_health(server: RemoteServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 512
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/version")).json()["version"]


def test_greedy_text_equals_llm_generate(server: RemoteServer, client: openai.OpenAI) -> None:
    from jaxserve import LLM, SamplingParams

    greedy = dict(temperature=0.0, max_tokens=24)
    served = client.completions.create(model=MODEL, prompt=PROMPTS, extra_body={"ignore_eos": True},
                                       **greedy)
    chat = client.chat.completions.create(model=MODEL, messages=HI, **greedy)
    llm = LLM(max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    offline = llm.generate(PROMPTS, SamplingParams(ignore_eos=True, **greedy), use_tqdm=False)
    offline_chat = llm.chat(HI, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    del llm
    assert [c.text for c in sorted(served.choices, key=lambda c: c.index)] == \
        [o.outputs[0].text for o in offline]
    assert served.usage.completion_tokens == 24 * len(PROMPTS)
    assert chat.choices[0].message.content == offline_chat.text
    assert chat.choices[0].finish_reason == offline_chat.finish_reason


def test_completion_stream_equals_non_stream(server: RemoteServer, client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0.0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    # The raw stream is SSE ending with [DONE].
    with httpx.stream("POST", server.url("/v1/completions"), json={**kw, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_continuous_usage_stats_and_a_missing_model(server: RemoteServer, client: openai.OpenAI) -> None:
    """vLLM's `continuous_usage_stats`: every chunk carries the usage so far; a missing or
    empty `model` is the served one (vLLM's behaviour)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in ((client.completions.create, dict(prompt=PROMPTS[0])),
                       (client.chat.completions.create, dict(messages=HI))):
        chunks = list(create(model=MODEL, max_tokens=6, temperature=0.0, stream=True,
                             stream_options=opts, extra_body={"ignore_eos": True}, **kw))
        used = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage.prompt_tokens > 0 for c in chunks)
        assert used == sorted(used) and used[-1] == 6 and chunks[-1].choices == []
    for body in ({"prompt": "x", "max_tokens": 2}, {"model": "", "prompt": "x", "max_tokens": 2}):
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


def test_chat_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=HI, max_tokens=30, temperature=0.0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens > 0


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], n=3, max_tokens=12, temperature=1.0,
                                  seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 36
    assert len({c.text for c in r.choices}) > 1  # seed + i per choice
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, n=2, max_tokens=8,
                                                 temperature=1.0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(texts.values())
    # As vLLM streams n > 1: one choice a chunk, each ending with its own finish reason.
    chunks += list(client.completions.create(model=MODEL, prompt=PROMPTS[2], n=3, max_tokens=5,
                                             temperature=1.0, stream=True))
    assert all(len(c.choices) == 1 for c in chunks)
    finished = [(type(c).__name__, c.choices[0].index) for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [("ChatCompletionChunk", 0), ("ChatCompletionChunk", 1),
                                ("Completion", 0), ("Completion", 1), ("Completion", 2)]
    # Two prompts x two choices.
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0.0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[6:10]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    kept = client.completions.create(stop=[stop], extra_body={"include_stop_str_in_output": True},
                                     **kw).choices[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    tok = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                     json={"prompt": full, "add_special_tokens": False}).json()["tokens"]
    r = client.completions.create(extra_body={"stop_token_ids": [tok[3]]}, **kw).choices[0]
    assert r.finish_reason == "stop" and r.model_extra["stop_reason"] == tok[3]


def test_seeds_and_vllm_sampling_fields(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=42, **kw).choices[0].text
    b = client.completions.create(seed=42, **kw).choices[0].text
    c = client.completions.create(seed=43, **kw).choices[0].text
    assert a == b and a != c
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, priority=1, ignore_eos=True)
    r = client.completions.create(seed=1, extra_body=extra, **kw)
    assert r.usage.completion_tokens == 16
    # min_tokens keeps EOS away: "Hi!" is answered in ~10 tokens otherwise.
    short = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, temperature=0,
                                            extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5


def test_prompt_logprobs_and_echo_with_logprobs(server: RemoteServer, client: openai.OpenAI) -> None:
    n_prompt = len(httpx.post(server.url("/tokenize"), json={"prompt": PROMPTS[0]},
                              timeout=10).json()["tokens"])
    r = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                         "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    assert all(1 <= len(e) <= 3 and all("logprob" in v and "rank" in v for v in e.values())
               for e in plp[1:])
    # echo + logprobs: the prompt's tokens first (the first without a logprob), then the output.
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True,
                  logprobs=1)
        if stream:
            tokens, token_logprobs, text = [], [], ""
            for chunk in client.completions.create(stream=True, **kw):
                c = chunk.choices[0]
                text += c.text
                if c.logprobs:
                    tokens += c.logprobs.tokens
                    token_logprobs += c.logprobs.token_logprobs
        else:
            c = client.completions.create(**kw).choices[0]
            text, tokens, token_logprobs = c.text, c.logprobs.tokens, c.logprobs.token_logprobs
        assert text.startswith(PROMPTS[0]) and len(tokens) == n_prompt + 3
        assert token_logprobs[0] is None and all(v is not None for v in token_logprobs[1:])
        # The prompt's logprobs are prompt_logprobs' own.
        for p, e in enumerate(plp[1:], start=1):
            assert any(abs(v["logprob"] - token_logprobs[p]) < 1e-4 for v in e.values())


def test_structured_outputs_through_the_openai_client(client: openai.OpenAI) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
        "required": ["city", "population", "landmarks"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris in JSON."}],
        max_tokens=120, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=5,
                                  temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Year:", max_tokens=8, temperature=1.0,
                                  extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch(r"(19|20)[0-9]{2}", r.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="invalid json"):
        client.chat.completions.create(model=MODEL, messages=HI, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    with pytest.raises(openai.BadRequestError, match="one structured output"):
        client.completions.create(model=MODEL, prompt="x", extra_body={
            "guided_regex": "a+", "guided_choice": ["a"]})


def test_logit_bias(server: RemoteServer, client: openai.OpenAI) -> None:
    the = httpx.post(server.url("/tokenize"), json={"prompt": " the", "add_special_tokens": False},
                     timeout=10).json()["tokens"][0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=1.0,
                                  logit_bias={str(the): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " the" * 6
    for bias in ({"x": 1}, {str(10**6): 1}, {str(the): 101}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=MODEL, prompt="x", logit_bias=bias)


def test_bad_words_and_allowed_token_ids(server: RemoteServer, client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    word = greedy.choices[0].text.split()[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
                                  extra_body={"ignore_eos": True, "bad_words": [word]})
    assert word not in r.choices[0].text.split() and r.choices[0].text != greedy.choices[0].text
    ids = httpx.post(server.url("/tokenize"), json={"prompt": " yes no maybe",
                                                    "add_special_tokens": False},
                     timeout=10).json()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10, temperature=1.0,
                                       seed=3, logprobs=True,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": ids})
    texts = {httpx.post(server.url("/detokenize"), json={"tokens": [i]}, timeout=10).json()["prompt"]
             for i in ids}
    assert {t.token for t in r.choices[0].logprobs.content} <= texts


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Greedy: the sampled token is the most likely one.
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values()) for i in range(8))
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPTS[0]) and len(r.choices[0].text) > len(PROMPTS[0])
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_echo_with_max_tokens_0_scores_the_prompt(server: RemoteServer, client: openai.OpenAI) -> None:
    """vLLM's (and evaluation harnesses') loglikelihood request: echo, logprobs, max_tokens 0
    gives the prompt back with its tokens' logprobs and generates nothing; without echo, a 400."""
    ids = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1, temperature=0)
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.text == PROMPTS[0] and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])
    longer = client.completions.create(**{**kw, "max_tokens": 2}).choices[0].logprobs
    assert longer.token_logprobs[:len(ids)] == c.logprobs.token_logprobs  # the same prompt scores
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert [ch.choices[0].text for ch in chunks if ch.choices] == [PROMPTS[0]]
    assert chunks[-1].usage.completion_tokens == 0
    bad = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_token_id_prompts_tokenize_detokenize(server: RemoteServer, client: openai.OpenAI) -> None:
    t = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    assert post(server, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == PROMPTS[0]
    by_ids = client.completions.create(model=MODEL, prompt=t["tokens"], max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    chat_t = post(server, "/tokenize", {"messages": HI}).json()
    assert chat_t["count"] == client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1).usage.prompt_tokens


def test_invocations_route_by_the_bodys_shape(server: RemoteServer) -> None:
    """SageMaker's /invocations, as vLLM serves it."""
    chat = post(server, "/invocations", {"messages": HI, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    cmpl = post(server, "/invocations", {"prompt": "Hi", "max_tokens": 2})
    assert cmpl.status_code == 200 and cmpl.json()["object"] == "text_completion"
    emb = post(server, "/invocations", {"input": "Hi"})
    assert emb.status_code == 200 and emb.json()["data"][0]["object"] == "embedding"
    for body, param in (({"nothing": 1}, None), ({"prompt": "x", "max_tokens": -1}, "max_tokens")):
        bad = post(server, "/invocations", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_tokenize_chat_equals_the_tokenizers_own(server: RemoteServer) -> None:
    """/tokenize with messages, tools and the template's flags gives the ids of the
    tokenizer's apply_chat_template(..., tokenize=True) for the same arguments (vLLM's)."""
    from jaxserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": {"type": "object"}}}]
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    for body in ({"messages": convo[:1]}, {"messages": convo[:1], "tools": tools},
                 {"messages": convo, "add_generation_prompt": False,
                  "continue_final_message": True}):
        ids = tok.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=True,
                                      add_generation_prompt=body.get("add_generation_prompt", True),
                                      continue_final_message=body.get("continue_final_message", False))
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert post(server, "/tokenize", body).json()["tokens"] == list(ids), body


def test_truncate_prompt_tokens(server: RemoteServer, client: openai.OpenAI) -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens (truncation_side "right": the first),
    -1 as many as fit; a text too long for the context is served once truncated."""
    ids = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    for side, kept in (("left", ids[-5:]), ("right", ids[:5])):
        r = client.completions.create(prompt=PROMPTS[0], extra_body={
            "truncate_prompt_tokens": 5, "truncation_side": side}, **kw)
        assert r.usage.prompt_tokens == 5
        assert r.choices[0].text == client.completions.create(prompt=kept, **kw).choices[0].text
    huge = "word " * 3000  # about 3,000 tokens against max_model_len 512
    r = client.completions.create(prompt=huge, extra_body={"truncate_prompt_tokens": -1}, **kw)
    assert r.usage.prompt_tokens == 512 - 4  # room for max_tokens
    chat = client.chat.completions.create(messages=[{"role": "user", "content": huge}],
                                          extra_body={"truncate_prompt_tokens": 100}, **kw)
    assert chat.usage.prompt_tokens == 100


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"return_tokens_as_token_ids": True})
    c = client.completions.create(prompt=PROMPTS[0], logprobs=2, echo=True, **kw).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in c.logprobs.tokens)
    assert all(k.startswith("token_id:") for top in c.logprobs.top_logprobs[1:] for k in top)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=1).usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(messages=HI, logprobs=True, top_logprobs=2, **kw)
    content = chat.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") and bytes(e.bytes).decode() == e.token
               and all(t.token.startswith("token_id:") for t in e.top_logprobs) for e in content)


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", ["nope"]),
    ("/v1/chat/completions", {"model": "nope", "messages": HI}, 404, "model", ["nope"]),
    ("/v1/completions", {"prompt": "x " * 600}, 400, "prompt", ["601", "512"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens", ["600", "512"]),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p", ["top_p"]),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ["temperature"]),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", ["n: ", "greater than or equal to 1"]),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", ["logprobs"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", ["max_tokens"]),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", ["prompt"]),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", ["49152", "1000000000"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"60000": 1, "5": 1}}, 400, "logit_bias",
     ["60000", "49152"]),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [3, 99999]}, 400, "stop_token_ids",
     ["99999", "49152"]),
    ("/v1/completions", {"prompt": []}, 400, "prompt", ["at least 1"]),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", ["logprobs"]),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs", ["20"]),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", ["messages"]),
    ("/v1/chat/completions", {"messages": HI, "stop": [""]}, 400, "stop", ["stop"]),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", ["`stream=True`"]),
    ("/v1/chat/completions", {"messages": HI, "stream": False, "stream_options": {}}, 400,
     "stream_options", ["`stream=True`"]),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search",
     ["use_beam_search is not supported"]),
    ("/v1/chat/completions", {"messages": HI, "truncate_prompt_tokens": 513}, 400,
     "truncate_prompt_tokens", ["(513) is greater than max_model_len (512)"]),
    ("/v1/chat/completions", {"messages": HI, "return_tokens_as_token_ids": True}, 400,
     "return_tokens_as_token_ids", ["needs logprobs"]),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}, 400,
     "truncate_prompt_tokens", ["greater than or equal to -1"]),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10**6]}, 400, "allowed_token_ids",
     ["49152", "1000000"]),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids",
     ["at least 1"]),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, 400,
     "structured_outputs", ["empty"]),
    ("/v1/completions", {"prompt": "x", "guided_choice": [f"option {i}" for i in range(5000)]},
     400, "guided_choice", ["5000 strings", "1999"]),
])
def test_errors(server: RemoteServer, path: str, body: dict, status: int, param: str,
                words: list[str]) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]


def test_errors_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_model_len is 512"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 600}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", stream=True, extra_body={"top_k": -5})


# --- disconnects, load, metrics -----------------------------------------------------------


def test_disconnect_mid_stream_frees_the_request(server: RemoteServer) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    generated = wait_idle(server)["vllm:generation_tokens_total"]
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        # Held in a name: breaking out of a bare `for line in r.iter_lines()` closes the
        # generator, and httpx closes the connection with it (the abort would race the gauge).
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        deadline = time.monotonic() + 30
        while server.metrics()["vllm:num_requests_running"] < 1:  # the gauge may lag
            assert time.monotonic() < deadline, "the streaming request never showed as running"
            time.sleep(0.05)
    # Leaving the block closed the connection mid-stream.
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert 3 <= m["vllm:generation_tokens_total"] - generated < 400, "not aborted"

    # A non-streaming request whose client gives up (once the engine runs it) is aborted too.
    async def give_up() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.ensure_future(client.post(server.url("/v1/completions"), json={
                "prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True}))
            while (await asyncio.to_thread(server.metrics))["vllm:num_requests_running"] < 1:
                assert not task.done(), "the request finished before it was seen running"
                await asyncio.sleep(0.02)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(give_up())
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_64_concurrent_streams_all_complete(server: RemoteServer) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"{PROMPTS[i % 4]} {i}", max_tokens=12, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, reason = 0, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return usage, reason

    async def main() -> list[tuple[int, str | None]]:
        client = server.async_client(timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert results == [(12, "length")] * 64
    wait_idle(server)


def test_metrics(server: RemoteServer) -> None:
    m = server.metrics()
    names = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
             "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
             "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
             "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
             "request_queue_time_seconds_count", "request_prefill_time_seconds_count",
             "request_decode_time_seconds_count", "iteration_tokens_total_count",
             "request_params_n_count", "request_params_max_tokens_count", "cache_config_info"]
    for name in names:
        assert f"vllm:{name}" in m, name
    assert m["vllm:e2e_request_latency_seconds_count"] >= 64
    assert m["vllm:time_to_first_token_seconds_sum"] > 0
    assert m["vllm:prefix_cache_hits_total"] > 0  # repeated prompts above
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] > 64 * 12
    assert json.loads(json.dumps(m))  # plain numbers


def test_bench_serve_reports_what_vllm_reports(server: RemoteServer, tmp_path) -> None:
    from jaxserve.bench.__main__ import main as bench_main

    out = tmp_path / "bench.json"
    bench_main(["serve", "--base-url", server.base_url, "--num-prompts", "4", "--max-concurrency", "2",
                "--random-input-len", "16", "--random-output-len", "8", "--output-json", str(out)])
    m = json.loads(out.read_text())
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == 32 and 60 <= m["total_input_tokens"] <= 68
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert m[f"{stat}_{key}_ms"] > 0
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0


def test_bench_serve_mixed_lengths_and_shared_prefix(server: RemoteServer, tmp_path) -> None:
    from jaxserve.bench.__main__ import main as bench_main

    out = tmp_path / "bench.json"
    bench_main(["serve", "--base-url", server.base_url, "--num-prompts", "6", "--max-concurrency", "3",
                "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "0.5",
                "--random-prefix-len", "32", "--metric-percentiles", "50,90,99",
                "--output-json", str(out)])
    m = json.loads(out.read_text())
    assert m["completed"] == 6 and m["failed"] == 0
    # Outputs of 4..12 tokens each; inputs of 32 shared + 8..24 own tokens each.
    assert 6 * 4 <= m["total_output_tokens"] <= 6 * 12
    assert 6 * (32 + 8) - 6 <= m["total_input_tokens"] <= 6 * (32 + 24) + 6
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("p50", "p90", "p99"):
            assert m[f"{stat}_{key}_ms"] > 0


def test_bench_lengths_follow_vllms_range_rule() -> None:
    import numpy as np

    from jaxserve.bench.online import sample_lengths

    lens = sample_lengths(100, 0.25, 2000, np.random.default_rng(0))
    assert lens.min() == 75 and lens.max() == 125
    assert (sample_lengths(100, 0.0, 5, np.random.default_rng(0)) == 100).all()
    with pytest.raises(ValueError, match="random-range-ratio"):
        sample_lengths(100, 1.5, 5, np.random.default_rng(0))
