"""LLM.embed with the real default model, float32, against transformers' final hidden states
pooled the same way: several inputs in one batch, chunked prefill, prefix caching, and
embedding requests beside generation in one engine."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, PoolingParams, SamplingParams
from jaxserve.engine.processor import POOLING_SAMPLING_PARAMS

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Hello",
    ("Photosynthesis is the process by which plants convert sunlight, water and carbon dioxide "
     "into glucose and oxygen. It happens in the chloroplasts, which contain chlorophyll, the "
     "green pigment that absorbs light. The light reactions make ATP and NADPH; the Calvin "
     "cycle then fixes carbon dioxide into sugars that feed the plant and, in the end, us."),
    "def add(a, b):\n    return a + b",
]
# 64-token steps: the long prompt (~80 tokens) is split over steps (chunked prefill).
ENGINE = dict(max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=256 << 20,
              max_num_batched_tokens=64, enforce_eager=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def hidden(llm: LLM, hf_default_model) -> list[np.ndarray]:
    """transformers' final-norm hidden states of each prompt, [tokens, hidden]."""
    import torch

    tok = llm.get_tokenizer()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok(p).input_ids])
            out.append(hf_default_model(ids, output_hidden_states=True).hidden_states[-1][0].numpy())
    return out


def pooled(h: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling].astype(np.float64)
    return v / np.linalg.norm(v) if normalize else v


def test_the_long_prompt_is_chunked(llm: LLM) -> None:
    assert len(llm.get_tokenizer()(PROMPTS[2]).input_ids) > ENGINE["max_num_batched_tokens"]


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(llm: LLM, hidden, pooling: str) -> None:
    for normalize in (True, False):
        outs = llm.embed(PROMPTS, PoolingParams(pooling, normalize), use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [llm.get_tokenizer()(p).input_ids
                                                      for p in PROMPTS]
        for o, h in zip(outs, hidden):
            want = pooled(h, pooling, normalize)
            got = np.asarray(o.outputs.embedding)
            assert o.finished and got.shape == want.shape == (576,)
            # Unit vectors within 1e-4; raw states (entries up to ~10^2) within 1e-4 of the
            # largest entry.
            scale = 1.0 if normalize else np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)


def test_default_is_last_token_normalized_and_prefix_cached(llm: LLM, hidden) -> None:
    first, again = llm.embed([PROMPTS[2], PROMPTS[2]], use_tqdm=False)
    np.testing.assert_allclose(first.outputs.embedding, pooled(hidden[2], "LAST", True), atol=1e-4)
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-5)
    # LAST reads only the last position: the second one reuses the first one's pages.
    (cached,) = llm.embed(PROMPTS[2], use_tqdm=False)
    assert cached.num_cached_tokens >= 64
    np.testing.assert_allclose(cached.outputs.embedding, first.outputs.embedding, atol=1e-5)
    # MEAN needs every position's state: it never skips the cached prefix.
    (mean,) = llm.embed(PROMPTS[2], PoolingParams("MEAN"), use_tqdm=False)
    assert mean.num_cached_tokens == 0


def test_embedding_beside_generation_in_one_batch(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone_tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    alone_vectors = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    ids = []
    for p in PROMPTS:  # interleaved in one engine run
        ids.append(llm._add_request(p, greedy, 0))
        ids.append(llm._add_request(p, POOLING_SAMPLING_PARAMS, 0, PoolingParams()))
    outs = llm._run(ids, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[0::2]] == alone_tokens
    for o, v in zip(outs[1::2], alone_vectors):
        np.testing.assert_allclose(o.outputs.embedding, v, atol=1e-5)


def test_bad_embedding_inputs_are_value_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="embedding input may have at most 511"):
        llm.embed({"prompt_token_ids": [1] * 512})
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.embed({"prompt_token_ids": []})
