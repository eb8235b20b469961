"""Gemma 2 and Gemma 3 (text) against transformers, float32, on tiny random checkpoints:
logits within 1e-4 with sliding and full layers mixed in one layer scan, soft caps and Gemma
3's two ropes; through the engine (and its sliding-window KV cache groups), greedy tokens and
prompt logprobs on prompts longer than the window, for Gemma 2, Gemma 3 and Mistral."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.models import LlamaForCausalLM
from jaxserve.models.loaders import load_checkpoint
from tests.models.forward import prompt_logits
from tests.models.tiny import hf_greedy, hf_logits, hf_prompt_logprobs, on_fake_devices, save_tiny_hf

PROMPTS = [list(range(10, 60)), [3], [(5 * i) % 120 + 1 for i in range(23)]]
WINDOW = 8  # every prompt but one is longer: local layers see only the last 8 keys
GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
KINDS = {
    "gemma2": dict(num_hidden_layers=4, sliding_window=WINDOW),
    # Layer kinds in no period, and the full layers' rope scaled (Gemma 3 4B and up).
    "gemma3": dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=GEMMA3_TYPES,
                   rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


def tiny_gemma(kind: str, out_dir: str) -> str:
    # Larger weights than transformers' default init: the caps and windows move the logits.
    return save_tiny_hf(kind, out_dir, initializer_range=0.2, **KINDS[kind])


@pytest.mark.parametrize("kind", list(KINDS))
def test_gemma_logits_match_transformers(kind: str, tmp_path) -> None:
    model_dir = tiny_gemma(kind, str(tmp_path))
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.gemma == int(kind[-1]) and arch.local_layers is not None
    if kind == "gemma3":
        assert arch.local_rope_theta == 1e4 and arch.rope_scaling.rope_type == "linear"
        assert arch.qk_norm and arch.final_logit_softcap is None
    else:
        assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    model = LlamaForCausalLM(arch)
    for ids in PROMPTS:
        ours, ref = prompt_logits(model, params, ids), hf_logits(model_dir, ids)
        assert np.abs(ours - ref).max() <= 1e-4, kind
    # The windows matter: every layer full gives other logits past the window.
    full = LlamaForCausalLM(dataclasses.replace(arch, layer_types=None, sliding_window=None))
    assert np.abs(prompt_logits(full, params, PROMPTS[-1]) - ref).max() > 1e-2


def test_gemma3_with_every_layer_sliding_takes_the_sliding_rope(tmp_path) -> None:
    """Layers of one kind, all sliding (a Gemma 3 without full layers, or a pipeline stage of
    only sliding ones): each takes the sliding layers' rope base, not the full layers'."""
    model_dir = save_tiny_hf("gemma3", str(tmp_path), initializer_range=0.2, num_hidden_layers=2,
                             sliding_window=WINDOW, layer_types=["sliding_attention"] * 2)
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.local_layers is None and arch.local_rope_theta != arch.rope_theta
    ours, ref = prompt_logits(LlamaForCausalLM(arch), params, PROMPTS[0]), hf_logits(model_dir, PROMPTS[0])
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "mistral"])
def test_sliding_windows_through_the_engine(kind: str, tmp_path) -> None:
    """Chunked prefill (8-token steps) over prompts up to ten windows long (window 8), the
    platform's attention kernel, decoding past them, sliding groups giving pages back, prefix
    hits and preemption in a cache too small for all at once: transformers' greedy tokens and
    prompt logprobs. Gemma 3: a full group and three sliding ones; Gemma 2: one of each;
    Mistral: one all-sliding group."""
    from jaxserve import LLM, SamplingParams

    model_dir = (save_tiny_hf("mistral", str(tmp_path), sliding_window=WINDOW)
                 if kind == "mistral" else tiny_gemma(kind, str(tmp_path)))
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=8, block_size=4,
              num_gpu_blocks_override={"mistral": 10, "gemma2": 36, "gemma3": 48}[kind],
              enforce_eager=True)
    groups = llm.config.resolved.kv_cache_groups
    assert [g.sliding_window for g in groups.groups] == {
        "gemma3": [None, WINDOW, WINDOW, WINDOW], "gemma2": [None, WINDOW], "mistral": [WINDOW],
    }[kind]
    # Four long requests do not fit the cache at once: some are preempted and resumed.
    prompts = PROMPTS + [list(range(86, 6, -1)), PROMPTS[2], PROMPTS[0] + [7, 8, 9]]
    want = hf_greedy(model_dir, prompts, 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:5]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:5]
    assert llm.engine_core.scheduler.total_num_preemptions > 0
    # A prefix hit: the full group's 12 pages, the sliding groups' last two (the window).
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, use_tqdm=False)
    (out,) = llm.generate([{"prompt_token_ids": prompts[5]}], greedy, use_tqdm=False)
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == want[5]
    # Prompt logprobs over every chunk of a prompt ten windows long.
    with_lps = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompts[3]}], with_lps, use_tqdm=False)
    ours = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    assert np.abs(np.asarray(ours) - hf_prompt_logprobs(model_dir, prompts[3])).max() <= 2e-3


@pytest.mark.slow
def test_gemma2_under_tensor_parallelism_on_fake_devices(tmp_path) -> None:
    """Heads split over 2 devices, each layer's branch under shard_map: the same tokens."""
    model_dir = tiny_gemma("gemma2", str(tmp_path))
    res = on_fake_devices(model_dir, [[2, False]], PROMPTS)
    assert res["tp2-ep0"]["tokens"] == hf_greedy(model_dir, PROMPTS, 16)
