"""POST /v1/embeddings (and vLLM's /pooling) through the openai SDK: the default model behind
`--pooler-config` MEAN without normalization and 32-token steps (chunked prefill), against
transformers' hidden states; beside chat requests on the same engine; bad inputs are 400s."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest

from .server_utils import EAGER, SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["Hello, world", ("The quick brown fox jumps over the lazy dog, again and again, while "
                          "the farmer watches from the porch and the sun sets slowly behind the "
                          "hills of the valley.")]


@pytest.fixture(scope="module")
def server():
    with RemoteServer([*SMALL_ENGINE_ARGS, *EAGER, "--max-num-batched-tokens", "32", "--pooler-config",
                       json.dumps({"pooling_type": "MEAN", "normalize": False})]) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server: RemoteServer, hf_default_model) -> list[np.ndarray]:
    """transformers' final hidden states averaged over each text's tokens."""
    import torch

    ids = [httpx.post(server.url("/tokenize"), json={"prompt": t}).json()["tokens"] for t in TEXTS]
    assert len(ids[1]) > 32  # split over steps
    with torch.no_grad():
        return [hf_default_model(torch.tensor([i]), output_hidden_states=True)
                .hidden_states[-1][0].mean(0).numpy() for i in ids]


def close(got, want: np.ndarray) -> None:
    # Raw states (entries up to ~10^2): within 1e-4 of the largest entry.
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_embeddings_create_batched_base64_and_float(server: RemoteServer, reference) -> None:
    client = server.client()
    r = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL and r.object == "list"
    for d, want in zip(r.data, reference):
        close(d.embedding, want)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 32
    raw = httpx.post(server.url("/v1/embeddings"), json={"input": TEXTS[0],
                                                          "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    close(vec, reference[0])
    floats = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    close(floats.data[0].embedding, reference[1])
    # Token ids are the same input; vLLM's `normalize` overrides the server's default.
    ids = httpx.post(server.url("/tokenize"), json={"prompt": TEXTS[0]}).json()["tokens"]
    unit = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float",
                                    extra_body={"normalize": True})
    close(unit.data[0].embedding, reference[0] / np.linalg.norm(reference[0]))
    pooling = httpx.post(server.url("/pooling"), json={"input": ids}).json()
    assert pooling["data"][0]["object"] == "pooling"
    close(pooling["data"][0]["data"], reference[0])


def test_vllms_extras_messages_dtypes_use_activation(server: RemoteServer, reference) -> None:
    post = lambda body: httpx.post(server.url("/v1/embeddings"), json=body, timeout=60)  # noqa: E731
    msgs = [{"role": "user", "content": TEXTS[0]}]
    ids = httpx.post(server.url("/tokenize"), json={"messages": msgs,
                                                     "add_generation_prompt": False}).json()["tokens"]
    by_chat = post({"messages": msgs})
    assert by_chat.json()["usage"]["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(by_chat.json()["data"][0]["embedding"],
                               post({"input": [ids]}).json()["data"][0]["embedding"], rtol=1e-6)
    import ml_dtypes

    for dtype, np_dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        raw = post({"input": TEXTS[0], "encoding_format": "base64", "embed_dtype": dtype,
                    "endianness": "big"}).json()["data"][0]["embedding"]
        vec = np.frombuffer(base64.b64decode(raw), ">u2").astype("=u2").view(np_dtype)
        np.testing.assert_allclose(vec.astype(np.float32), reference[0], rtol=1e-2,
                                   atol=1e-2 * np.abs(reference[0]).max())
    unit = post({"input": TEXTS[0], "use_activation": True}).json()["data"][0]["embedding"]
    close(unit, reference[0] / np.linalg.norm(reference[0]))
    for body, param in (({"input": "x", "use_activation": True, "normalize": False}, "use_activation"),
                        ({"input": "x", "messages": msgs}, "input"), ({}, "input")):
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_score_and_rerank_are_cosines_of_embeddings(server: RemoteServer) -> None:
    """vLLM's /score and /rerank with an embedding model: cosine similarity of the texts'
    embeddings."""
    post = lambda path, body: httpx.post(server.url(path), json=body, timeout=60)  # noqa: E731
    docs = ["A fox jumps.", "Stock markets fell.", TEXTS[1]]
    vecs = [np.asarray(d["embedding"]) for d in post("/v1/embeddings", {"input": [TEXTS[0], *docs]}).json()["data"]]
    cos = [float(vecs[0] @ v / np.linalg.norm(vecs[0]) / np.linalg.norm(v)) for v in vecs[1:]]
    for path in ("/score", "/v1/score"):
        one = post(path, {"text_1": TEXTS[0], "text_2": docs}).json()
        assert [d["index"] for d in one["data"]] == [0, 1, 2] and one["object"] == "list"
        np.testing.assert_allclose([d["score"] for d in one["data"]], cos, atol=1e-5)
    pairs = post("/score", {"text_1": [TEXTS[0]] * 3, "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], cos, atol=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = post(path, {"query": TEXTS[0], "documents": docs, "top_n": 2}).json()
        assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -cos[i])[:2]
        assert r["results"][0]["document"]["text"] == docs[r["results"][0]["index"]]
        assert r["usage"]["total_tokens"] > 0
    for path, body, param in (("/rerank", {"query": "q", "documents": []}, "documents"),
                              ("/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
                              ("/score", {"text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_1")):
        bad = post(path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    refused = post("/classify", {"input": "x"})
    assert refused.status_code == 400, refused.text
    assert "does not support Classification API" in refused.json()["error"]["message"]



def test_pooling_token_embed_is_every_prompt_tokens_state(server: RemoteServer, reference) -> None:
    """vLLM's /pooling task token_embed: one vector per prompt token, over chunked prefill (the
    long text spans several 32-token steps); their mean is the MEAN embedding."""
    body = {"input": TEXTS[1], "task": "token_embed", "use_activation": False}
    r = httpx.post(server.url("/pooling"), json=body, timeout=60).json()
    rows = np.asarray(r["data"][0]["data"])
    assert rows.shape == (r["usage"]["prompt_tokens"], 576)
    close(rows.mean(0), reference[1])
    unit = httpx.post(server.url("/pooling"), json={**body, "use_activation": True}).json()
    np.testing.assert_allclose(np.linalg.norm(unit["data"][0]["data"], axis=-1), 1.0, atol=1e-5)


def test_embeddings_beside_chat_on_one_engine(server: RemoteServer, reference) -> None:
    client = server.async_client()

    async def both():
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=16,
            temperature=0.0)
        embeds = [client.embeddings.create(model=MODEL, input=TEXTS) for _ in range(4)]
        return await asyncio.gather(chat, *embeds)

    chat, *embeds = asyncio.run(both())
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    for r in embeds:
        for d, want in zip(r.data, reference):
            close(d.embedding, want)


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [[1, 2], []]}, 400, "input"),
    ({"input": [5, 10**6]}, 400, "input"),
    ({"input": "word " * 600}, 400, "input"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "x", "model": "nope"}, 404, "model"),
])
def test_bad_inputs(server: RemoteServer, body: dict, status: int, param: str) -> None:
    r = httpx.post(server.url("/v1/embeddings"), json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"].startswith(param)
    with pytest.raises(openai.APIStatusError):
        server.client().embeddings.create(model=body.get("model", MODEL),
                                          **{k: v for k, v in body.items() if k != "model"})
