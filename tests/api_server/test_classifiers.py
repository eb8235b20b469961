"""Sequence classifiers, as vLLM serves them: a tiny random LlamaForSequenceClassification
(three labels) through the offline LLM's classify, and a tiny Qwen3 causal LM made a
Qwen3-Reranker-style yes/no classifier by --hf-overrides behind the server's /score,
/rerank, /classify and /pooling. Every figure is checked against transformers on the same
checkpoint; what a classifier cannot serve is refused with vLLM's words."""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

from tests.models.tiny import save_tiny_hf

from .server_utils import EAGER, RemoteServer

# float32 weights everywhere (a CPU with bf16 units would otherwise get bf16 ones).
TINY_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
             "--block-size", "8", "--kv-cache-memory-bytes", str(8 << 20), *EAGER]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
TEXTS = ["the cat sat on the mat", "a dog ran", "Paris is in France"]


def save_char_tokenizer(model_dir: str) -> None:
    """A character-level fast tokenizer whose pairs read `<bos> a <eos> b` (a cross-encoder's
    `tokenizer(a, text_pair=b)`), with "yes" and "no" as whole tokens (a reranker's)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    chars = [" ", *map(chr, range(ord("a"), ord("z") + 1)), *map(chr, range(ord("A"), ord("Z") + 1)), *".,?"]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "no": 4, "yes": 5,
             **{c: 6 + i for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <eos> $B:1", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(model_dir)


def tiny_classifier(kind: str, out_dir: str) -> str:
    """A random `kind` *ForSequenceClassification with three named labels (score.weight, no
    lm_head), norms perturbed as tests/models/tiny.py does."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, pad_token_id=0)
    config, model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3TextForSequenceClassification),
    }[kind]
    extra = {"head_dim": 16} if kind == "gemma3" else {}
    model = model(config(**common, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = os.path.join(out_dir, f"{kind}-cls")
    model.save_pretrained(path, safe_serialization=True)
    save_char_tokenizer(path)
    return path


def hf_last_logits(model_dir: str, ids: list[int], causal: bool) -> np.ndarray:
    import torch
    import transformers

    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForSequenceClassification
    model = cls.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits
    return (out[0, -1] if causal else out[0]).numpy().astype(np.float64)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_llm_classify_equals_transformers(kind, tmp_path) -> None:
    from jaxserve import LLM

    path = tiny_classifier(kind, str(tmp_path))
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
              kv_cache_memory_bytes=8 << 20, enforce_eager=True)
    outs = llm.classify(TEXTS, use_tqdm=False)
    logits = llm.classify(TEXTS[0], use_activation=False, use_tqdm=False)[0].outputs.probs
    tok = llm.get_tokenizer()
    for text, out in zip(TEXTS, outs):
        ref = hf_last_logits(path, tok(text).input_ids, causal=False)
        np.testing.assert_allclose(out.outputs.probs, np.exp(ref) / np.exp(ref).sum(), atol=2e-4)
    ref = hf_last_logits(path, tok(TEXTS[0]).input_ids, causal=False)
    np.testing.assert_allclose(logits, ref, atol=2e-4)
    with pytest.raises(ValueError, match="only enabled for num_labels == 1"):
        llm.score("a", "b")  # three labels: no score, as vLLM
    with pytest.raises(ValueError, match="does not support generation"):
        llm.generate("hello")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = save_tiny_hf("qwen3", str(tmp_path_factory.mktemp("reranker")), tie_word_embeddings=False)
    save_char_tokenizer(path)
    with RemoteServer([path, *TINY_ARGS, "--hf-overrides", json.dumps(RERANKER),
                       "--served-model-name", "tiny-reranker"]) as s:
        yield s, path


def reranker_score(path: str, query: str, doc: str) -> float:
    """What Qwen3-Reranker's model card computes: p(yes) against p(no) at the last token of
    the text query + document (vLLM's `llm as reranker` pairs: no separator)."""
    from transformers import AutoTokenizer

    logits = hf_last_logits(path, AutoTokenizer.from_pretrained(path)(query + doc).input_ids, True)
    no, yes = logits[4], logits[5]
    return float(np.exp(yes) / (np.exp(yes) + np.exp(no)))


def test_score_rerank_classify_pooling_on_a_reranker(reranker) -> None:
    server, path = reranker
    post = lambda route, body: httpx.post(server.url(route), json=body, timeout=60)  # noqa: E731
    docs = TEXTS
    want = [reranker_score(path, "where is Paris?", d) for d in docs]
    score = post("/v1/score", {"model": "tiny-reranker", "text_1": "where is Paris?", "text_2": docs})
    assert score.status_code == 200, score.text
    np.testing.assert_allclose([d["score"] for d in score.json()["data"]], want, atol=2e-4)
    rerank = post("/rerank", {"query": "where is Paris?", "documents": docs, "top_n": 2}).json()
    assert [r["index"] for r in rerank["results"]] == list(np.argsort(want)[::-1][:2])
    np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]],
                               sorted(want, reverse=True)[:2], atol=2e-4)
    classify = post("/classify", {"input": ["where is Paris?" + docs[2]]}).json()
    assert classify["data"][0]["num_classes"] == 1 and classify["data"][0]["label"] == "LABEL_0"
    np.testing.assert_allclose(classify["data"][0]["probs"], [want[2]], atol=2e-4)
    assert classify["usage"]["prompt_tokens"] == len("where is Paris?" + docs[2]) + 1  # + <bos>
    pooled = post("/pooling", {"input": "where is Paris?" + docs[2]}).json()  # classify by default
    np.testing.assert_allclose(pooled["data"][0]["data"], [want[2]], atol=2e-4)
    # SageMaker's /invocations routes by the body's shape, to the classifier's endpoints.
    routed = post("/invocations", {"query": "where is Paris?", "documents": docs}).json()
    assert [r["index"] for r in routed["results"]] == list(np.argsort(want)[::-1])
    routed = post("/invocations", {"input": "where is Paris?" + docs[2]}).json()
    np.testing.assert_allclose(routed["data"][0]["probs"], [want[2]], atol=2e-4)
    routed = post("/invocations", {"text_1": "where is Paris?", "text_2": docs[:1]}).json()
    np.testing.assert_allclose(routed["data"][0]["score"], want[0], atol=2e-4)


@pytest.mark.parametrize("route,body,message", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "does not support generation"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "does not support generation"),
    ("/v1/embeddings", {"input": "hi"}, "does not support Embeddings API"),
    ("/pooling", {"input": "hi", "task": "token_embed"}, "does not support the token_embed task"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
])
def test_what_a_classifier_refuses(reranker, route, body, message) -> None:
    server, _ = reranker
    r = httpx.post(server.url(route), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert message in json.dumps(r.json()["error"])
    assert httpx.get(server.url("/health")).status_code == 200
