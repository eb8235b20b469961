"""The decoder against transformers (torch, CPU) on the same weights, in float32.

Bound: max |logit difference| <= 1e-3 for the tiny models (logits of size ~1)
and <= 2e-3 for the real default model, whose logits reach ~30, and the top-1
token equal at every position.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.models import LlamaForCausalLM
from jaxserve.models.attention import ModelOptions
from jaxserve.models.loaders import load_checkpoint
from tests.models.forward import prompt_logits
from tests.models.tiny import hf_logits, save_tiny_hf

PROMPTS = [
    [1, 5, 9, 22, 7, 3, 100, 42, 17, 64, 2, 33, 90, 11, 8, 120, 77, 4, 5, 6],  # crosses a page
    [3],
    list(range(10, 60)),
]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_tiny_models_match_transformers(kind: str, tmp_path) -> None:
    model_dir = save_tiny_hf(kind, str(tmp_path))
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.attention_bias == (kind == "qwen2")
    assert arch.qk_norm == (kind == "qwen3")
    model = LlamaForCausalLM(arch)
    for ids in PROMPTS:
        ours = prompt_logits(model, params, ids)
        ref = hf_logits(model_dir, ids)
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
        assert np.abs(ours - ref).max() <= 1e-3


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_mistral_sliding_window_matches_transformers(tmp_path, backend: str) -> None:
    # A window of 8 over 50-token prompts: most keys are out of sight.
    model_dir = save_tiny_hf("mistral", str(tmp_path), sliding_window=8)
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.sliding_window == 8
    model = LlamaForCausalLM(arch, ModelOptions(attention_backend=backend))
    full = LlamaForCausalLM(dataclasses.replace(arch, sliding_window=None), ModelOptions(attention_backend=backend))
    ids = PROMPTS[2]
    ours, ref = prompt_logits(model, params, ids), hf_logits(model_dir, ids)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert np.abs(ours - ref).max() <= 1e-3
    assert np.abs(prompt_logits(full, params, ids) - ref).max() > 1e-2  # the window matters


def test_llama3_rope_scaling_matches_transformers(tmp_path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    }
    model_dir = save_tiny_hf("llama", str(tmp_path), rope_scaling=rope, rope_theta=500000.0)
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.rope_scaling is not None
    model = LlamaForCausalLM(arch)
    ids = list(range(1, 120))
    ours = prompt_logits(model, params, ids)
    ref = hf_logits(model_dir, ids)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert np.abs(ours - ref).max() <= 1e-3


def test_separate_lm_head(tmp_path) -> None:
    model_dir = save_tiny_hf("llama", str(tmp_path), tie_word_embeddings=False)
    arch, params = load_checkpoint(model_dir, np.float32)
    assert not arch.tie_word_embeddings and "lm_head" in params["params"]
    ours = prompt_logits(LlamaForCausalLM(arch), params, PROMPTS[0])
    assert np.abs(ours - hf_logits(model_dir, PROMPTS[0])).max() <= 1e-3
