"""Rope scalings of long-context checkpoints against transformers (float32, tiny random Llama
checkpoints): logits within 1e-4 at every position of prompts shorter and longer than the
pretrained context, and a scaling that changes the logits (not a no-op)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.models import LlamaForCausalLM
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loaders import load_checkpoint
from tests.models.forward import prompt_logits
from tests.models.tiny import hf_logits, save_tiny_hf

HALF = 8  # head_dim 16: 8 frequencies
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                 "long_factor": [1.0 + 2.0 * i for i in range(HALF)]},
}
# max_position_embeddings 32: the second prompt runs past the pretrained context (dynamic,
# longrope switch there); longrope's factor is 128 / 32.
PROMPTS = [list(range(5, 25)), [(7 * i) % 120 + 1 for i in range(90)]]


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_scaling_matches_transformers(name: str, tmp_path) -> None:
    rope = {**ROPES[name], "rope_theta": 10000.0}
    max_pos = 128 if rope["rope_type"] == "longrope" else 32
    model_dir = save_tiny_hf("llama", str(tmp_path), rope_scaling=rope, head_dim=16,
                             max_position_embeddings=max_pos)
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == rope["rope_type"]
    plain = LlamaForCausalLM(dataclasses.replace(arch, rope_scaling=None))
    for ids in PROMPTS:
        ours = prompt_logits(LlamaForCausalLM(arch), params, ids)
        ref = hf_logits(model_dir, ids)
        assert np.abs(ours - ref).max() <= 1e-4, name
    # Past the pretrained context every type changes the logits.
    assert np.abs(prompt_logits(plain, params, PROMPTS[1]) - ref).max() > 1e-3


def test_unknown_rope_type_is_a_clear_error() -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
           "rope_scaling": {"rope_type": "mrope", "factor": 2.0}}
    with pytest.raises(ValueError, match="'mrope' is not supported .*yarn, longrope"):
        ArchConfig.from_hf_config(cfg)


def _hf_greedy(model_dir: str, ids: list[int], n: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn", "phi4-mini"])
def test_ropes_through_the_engine(name: str, tmp_path) -> None:
    """Generation that crosses the pretrained context (32): for dynamic and longrope each
    step rotates its tokens for the sequence's length then, as transformers' generate does;
    8-token steps, and a checkpoint without tokenizer files (skip_tokenizer_init)."""
    from jaxserve import LLM, SamplingParams

    if name == "phi4-mini":  # Phi-3's fused weights, LongRoPE, partial rotary, a window
        d = int(16 * 0.75) // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(d)],
                "long_factor": [1.0 + 2.0 * i for i in range(d)]}
        model_dir = save_tiny_hf("phi3", str(tmp_path), head_dim=16, rope_scaling=rope,
                                 partial_rotary_factor=0.75, max_position_embeddings=128,
                                 original_max_position_embeddings=32, sliding_window=16,
                                 tie_word_embeddings=False)
    else:
        rope = {**ROPES[name], "rope_theta": 10000.0}
        max_pos = 128 if rope["rope_type"] == "longrope" else 32
        model_dir = save_tiny_hf("llama", str(tmp_path), rope_scaling=rope, head_dim=16,
                                 max_position_embeddings=max_pos)
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=8, block_size=4, kv_cache_memory_bytes=4 << 20,
              enforce_eager=True)
    prompts = [list(range(5, 25)), [3, 9, 27, 81, 50] * 5, [7]]  # 20, 25 and 1 tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(model_dir, p, 20) and o.outputs[0].text == ""
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate("text", greedy)


@pytest.mark.parametrize("partial, window", [(1.0, None), (0.75, 16)], ids=["phi3.5", "phi4-mini"])
def test_phi3_longrope_partial_rotary_and_window_match_transformers(
        partial: float, window: int | None, tmp_path) -> None:
    """Phi-3's fused weights split at load, LongRoPE, and Phi-4-mini's partial rotary."""
    d = int(16 * partial) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(d)],
            "long_factor": [1.0 + 2.0 * i for i in range(d)]}
    model_dir = save_tiny_hf("phi3", str(tmp_path), head_dim=16, rope_scaling=rope,
                             partial_rotary_factor=partial, max_position_embeddings=128,
                             original_max_position_embeddings=32, sliding_window=window,
                             tie_word_embeddings=False)
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.partial_rotary_factor == partial and arch.sliding_window == window
    assert arch.rope_scaling.original_max_position_embeddings == 32
    for ids in PROMPTS:
        ours, ref = prompt_logits(LlamaForCausalLM(arch), params, ids), hf_logits(model_dir, ids)
        assert np.abs(ours - ref).max() <= 1e-4
