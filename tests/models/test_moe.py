"""Mixtures of experts (Qwen3-MoE, Mixtral) against transformers, float32, on tiny random
checkpoints: logits within 1e-4 of one forward; greedy tokens through the whole engine (chunked
prefill, preemption) and under tensor, expert and pipeline parallelism on fake CPU devices.
"qwen3_moe-mixed" has dense layers among the sparse ones (mlp_only_layers)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.models import LlamaForCausalLM
from jaxserve.models.loaders import load_checkpoint
from tests.models.forward import prompt_logits
from tests.models.tiny import hf_logits, on_fake_devices, save_tiny_hf

PROMPTS = [list(range(10, 60)), [3], [(5 * i) % 120 + 1 for i in range(23)]]
# Larger weights than transformers' default init: routing and experts move the logits.
KINDS = {
    "qwen3_moe": {"initializer_range": 0.2},
    "qwen3_moe-unnormalized": {"initializer_range": 0.2, "norm_topk_prob": False},
    "mixtral": {"initializer_range": 0.2},
    # Layers 0 and 3 dense (SwiGLU of intermediate_size 96), 1 and 2 sparse.
    "qwen3_moe-mixed": {"initializer_range": 0.2, "num_hidden_layers": 4, "mlp_only_layers": [0, 3]},
}


def tiny_moe(name: str, out_dir: str) -> str:
    return save_tiny_hf(name.split("-")[0], out_dir, **KINDS[name])


@pytest.mark.parametrize("name", list(KINDS))
def test_moe_logits_match_transformers(name: str, tmp_path) -> None:
    model_dir = tiny_moe(name, str(tmp_path))
    arch, params = load_checkpoint(model_dir, np.float32)
    assert arch.num_experts in (4, 8) and arch.num_experts_per_tok == 2
    mlp = params["params"]["layers"]["mlp"]
    assert mlp["w_down"].shape == (2, arch.num_experts, arch.moe_intermediate_size, 64)
    if name.endswith("mixed"):  # each kind's stack over its own layers
        assert arch.moe_layers == (False, True, True, False)
        assert mlp["down_proj"]["kernel"].shape == (2, 96, 64) and mlp["gate"].shape == (2, 64, 8)
    model = LlamaForCausalLM(arch)
    for ids in PROMPTS:
        ours, ref = prompt_logits(model, params, ids), hf_logits(model_dir, ids)
        assert np.abs(ours - ref).max() <= 1e-4, name
    # Routing to one expert instead of two changes the logits: the test sees the experts.
    top1 = LlamaForCausalLM(dataclasses.replace(arch, num_experts_per_tok=1))
    assert np.abs(prompt_logits(top1, params, PROMPTS[-1]) - ref).max() > 1e-2


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3_moe-mixed"])
def test_moe_through_the_engine_with_chunks_and_preemption(name: str, tmp_path) -> None:
    from jaxserve import LLM, SamplingParams

    model_dir = tiny_moe(name, str(tmp_path))
    # 8-token steps; 23 pages of 4 tokens for sequences needing 32 in all: preemption.
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=72, max_num_seqs=4,
              max_num_batched_tokens=8, block_size=4, num_gpu_blocks_override=24,
              enforce_eager=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, PROMPTS, 16)
    assert llm.engine_core.scheduler.total_num_preemptions > 0


@pytest.mark.slow
def test_tensor_and_expert_parallel_on_fake_devices(tmp_path) -> None:
    model_dir = tiny_moe("qwen3_moe", str(tmp_path))
    # One device's float tokens equal transformers' in
    # test_moe_through_the_engine_with_chunks_and_preemption: not run again here.
    res = on_fake_devices(model_dir, [[2, False], [2, True], [4, True],
                                      [1, False, "int8"], [2, False, "int8"], [2, True, "int8"]],
                          PROMPTS)
    want = hf_greedy(model_dir, PROMPTS, 16)
    for key, r in res.items():
        # int8: the single device's int8 tokens under every split
        assert r["tokens"] == (res["tp1-ep0-int8"]["tokens"] if "int8" in key else want), key
        print(f"{key}: expert weights {r['expert_bytes_per_device']} of {r['expert_bytes']} "
              f"bytes per device, w_gate {r['w_gate_spec']}")
    # Expert parallelism: each device holds 1/EP of the experts, whole.
    assert res["tp2-ep1"]["w_gate_spec"] == "P(None, 'model', None, None)"
    assert res["tp4-ep1"]["expert_bytes_per_device"] * 4 == res["tp4-ep1"]["expert_bytes"]
    # Without it, each expert's intermediate columns are split instead.
    assert res["tp2-ep0"]["w_gate_spec"] == "P(None, None, None, 'model')"
    assert res["tp2-ep0"]["expert_bytes_per_device"] * 2 == res["tp2-ep0"]["expert_bytes"]


@pytest.mark.parametrize("platform", ["cpu", "xla"])
def test_int8_experts_equal_their_dequantized_floats(platform: str) -> None:
    """The int8 expert path (one expert dequantized per block on the CPU, the layer's stack
    before ragged_dot elsewhere) computes what the float path does on the same values."""
    import jax.numpy as jnp

    from jaxserve.models.moe import experts_ffn, route
    from jaxserve.models.quantization import dequantize_int8, quantize_int8

    rng = np.random.default_rng(0)
    E, H, I, T = 8, 64, 128, 40
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    weights, experts = route(x @ jnp.asarray(rng.normal(size=(H, E)), jnp.float32), 2, True)
    stacks = [rng.normal(0, 0.2, s).astype(np.float32) for s in ((E, H, I), (E, H, I), (E, I, H))]
    int8 = [quantize_int8(w, in_axis=-2) for w in stacks]
    floats = [jnp.asarray(np.swapaxes(np.asarray(dequantize_int8(q, s)), -1, -2)) for q, s in int8]
    want = experts_ffn(x, weights, experts, *floats, platform=platform)
    got = experts_ffn(x, weights, experts, *[(jnp.asarray(q), jnp.asarray(s)) for q, s in int8],
                      platform=platform)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_int8_mixture_of_experts_through_the_engine(tmp_path) -> None:
    """--quantization int8 covers the experts: int8 weights in place, greedy tokens mostly
    the float model's (a random tiny router flips experts on small changes: a loose bound)."""
    from jaxserve import LLM, SamplingParams

    model_dir = tiny_moe("qwen3_moe", str(tmp_path))
    kw = dict(skip_tokenizer_init=True, max_model_len=72, max_num_seqs=4,
              max_num_batched_tokens=8, block_size=4, kv_cache_memory_bytes=4 << 20,
              enforce_eager=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM(model_dir, quantization="int8", **kw)
    mlp = llm.engine.worker.stages[0].params["params"]["layers"]["mlp"]
    assert mlp["w_gate"]["qweight"].dtype == np.int8
    q = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    f = [o.outputs[0].token_ids for o in LLM(model_dir, **kw).generate(prompts, greedy,
                                                                       use_tqdm=False)]
    agree = np.mean([a == b for qa, fa in zip(q, f) for a, b in zip(qa, fa)])
    print(f"int8 MoE greedy tokens equal to float: {agree:.2f}")
    assert agree >= 0.5


def test_dense_layers_among_the_sparse_follow_transformers_rule(tmp_path) -> None:
    """Qwen3-MoE's layer kinds: sparse unless in mlp_only_layers, and only every
    decoder_sparse_step-th; all sparse is a plain MoE, none sparse a dense model. A pipeline
    stage keeps its own layers' kinds, and Orbax's config keeps them hashable."""
    import json

    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.loaders.orbax_loader import ARCH_FILE, read_orbax_arch

    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32}

    def kinds(**kw):
        arch = ArchConfig.from_hf_config({**base, **kw})
        return arch.num_experts, arch.moe_layers

    assert kinds() == (8, None)
    assert kinds(decoder_sparse_step=2) == (8, (False, True) * 3)
    assert kinds(decoder_sparse_step=2, mlp_only_layers=[3]) == (
        8, (False, True, False, False, False, True))
    assert kinds(mlp_only_layers=list(range(6))) == (0, None)  # every layer dense
    arch = ArchConfig.from_hf_config({**base, "decoder_sparse_step": 2})
    assert arch.mlp_stack_index == (0, 0, 1, 1, 2, 2)
    assert arch.layer_range(1, 2).moe_layers is None and arch.layer_range(1, 2).num_experts == 8
    assert arch.layer_range(2, 3).num_experts == 0  # a stage of one dense layer
    assert arch.layer_range(0, 4).moe_layers == (False, True, False, True)
    (tmp_path / ARCH_FILE).write_text(json.dumps(dataclasses.asdict(arch)))
    assert read_orbax_arch(str(tmp_path)) == arch
    hash(read_orbax_arch(str(tmp_path)))


@pytest.mark.slow
def test_dense_layers_among_the_sparse_on_fake_devices(tmp_path) -> None:
    """The mixed model under tensor and expert parallelism, int8, and four pipeline stages (one
    layer each: stages of a single kind) gives transformers' greedy tokens (int8: its own)."""
    model_dir = tiny_moe("qwen3_moe-mixed", str(tmp_path))
    res = on_fake_devices(model_dir, [[2, False], [2, True], [1, False, None, 4],
                                      [1, False, "int8"], [2, True, "int8"]], PROMPTS)
    want = hf_greedy(model_dir, PROMPTS, 16)
    for key, r in res.items():
        assert r["tokens"] == (res["tp1-ep0-int8"]["tokens"] if "int8" in key else want), key
    assert res["tp2-ep1"]["expert_bytes_per_device"] * 2 == res["tp2-ep1"]["expert_bytes"]
