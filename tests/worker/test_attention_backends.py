"""Every attention variant inside the whole engine, and how the engine picks one.

The Pallas GPU and TPU kernels run here in interpret mode (`attention_interpret=True`) on a
tiny random model, with chunked prefill mixing prefill chunks and decodes in one step; each
must give the reference's greedy tokens.
"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.resolve import resolve_attention_backend
from tests.models.tiny import save_tiny_hf

PROMPTS = [list(range(5, 45)), list(range(100, 107)), [7, 8, 9] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 16-token steps: prompts are chunked and decodes share steps with prefill chunks; 4-token
# pages so that sequences span several pages.
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
              kv_cache_memory_bytes=4 << 20, enforce_eager=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = save_tiny_hf("llama", str(tmp_path_factory.mktemp("tiny")), vocab_size=49152,
                        hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    from jaxserve.models.tokenizer import load_tokenizer

    load_tokenizer(None).save_pretrained(path)  # the default model's tokenizer beside it
    return path


def _greedy(model: str, backend: str, interpret: bool) -> list[list[int]]:
    llm = LLM(model, attention_backend=backend, attention_interpret=interpret, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference_tokens(tiny_model: str) -> list[list[int]]:
    return _greedy(tiny_model, "reference", False)


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_variant_in_engine_matches_reference(tiny_model: str, reference_tokens, backend: str) -> None:
    assert _greedy(tiny_model, backend, backend != "cpu") == reference_tokens


def test_auto_picks_the_platform_kernel() -> None:
    assert resolve_attention_backend("auto", "cpu", False) == "cpu"
    assert resolve_attention_backend("auto", "gpu", False) == "gpu"
    assert resolve_attention_backend("auto", "tpu", False) == "tpu"
    assert resolve_attention_backend("reference", "tpu", False) == "reference"


def test_a_kernel_for_another_platform_is_refused_unless_interpreted() -> None:
    with pytest.raises(ValueError, match=r"'gpu' targets cuda.*--attention-interpret"):
        resolve_attention_backend("gpu", "cpu", False)
    with pytest.raises(ValueError, match=r"'cpu' targets cpu, not this tpu"):
        resolve_attention_backend("cpu", "tpu", False)
    assert resolve_attention_backend("tpu", "cpu", True) == "tpu"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        resolve_attention_backend("nope", "cpu", False)


def test_llm_refuses_at_start_up(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="--attention-interpret"):
        LLM(tiny_model, attention_backend="tpu", **ENGINE)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sliding_window_in_engine_matches_transformers(tmp_path, backend: str) -> None:
    """Mistral's window (8 keys) through chunked prefill and decode, against transformers'
    greedy continuation (full recompute each token: no cache subtleties on its side)."""
    import torch
    import transformers

    path = save_tiny_hf("mistral", str(tmp_path), vocab_size=49152, sliding_window=8)
    from jaxserve.models.tokenizer import load_tokenizer

    load_tokenizer(None).save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = []
    for prompt in PROMPTS[:2]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        expected.append(ids[len(prompt):])
    llm = LLM(path, attention_backend=backend, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_fp8_kv_cache_and_int8_weights_in_the_engine(tiny_model: str) -> None:
    """An fp8 cache (its bits in uint8) holds 4x the pages of a float32 one in the same budget; with int8 weights
    on top the engine decodes mostly the float32 engine's greedy tokens (a tiny random model's
    logits are close together, so an exact match is not expected)."""
    import jax.numpy as jnp

    runs = {}
    for kv, q in (("auto", None), ("fp8", "int8")):
        llm = LLM(tiny_model, kv_cache_dtype=kv, quantization=q, **ENGINE)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        w = llm.engine.worker
        runs[kv] = ([o.outputs[0].token_ids for o in outs], w.num_blocks, w.kv_layout.storage_dtype)
        # Decode steps (few tokens) take the CPU int8 kernel; start-up logs which path runs.
        assert w.weight_matmul == (None if q is None else "CPU kernel up to 32 tokens a step, XLA beyond")
        llm.shutdown()
    assert runs["fp8"][2] == jnp.uint8 and runs["auto"][2] == jnp.float32
    assert runs["fp8"][1] == 4 * runs["auto"][1]
    firsts = [a[0] == b[0] for a, b in zip(runs["auto"][0], runs["fp8"][0])]
    assert all(len(t) == GREEDY.max_tokens for t in runs["fp8"][0]) and sum(firsts) >= 2
