"""GPT-OSS against transformers, float32, on a tiny random checkpoint with MXFP4 experts:
alternating sliding and full layers, attention sinks, biased attention and experts, the
clamped SwiGLU, YaRN; logits within 1e-4, and through the engine (sliding-window KV cache
groups, chunked prefill, preemption, a prefix hit) greedy tokens and prompt logprobs on
prompts ten windows long; with tensor and expert parallelism on fake devices."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.config import WeightFormat
from jaxserve.models import LlamaForCausalLM
from jaxserve.models.attention import ModelOptions
from jaxserve.models.checkpoint_quant import MXFP4_BLOCK, MXFP4_VALUES
from jaxserve.models.loaders import load_checkpoint
from tests.models.forward import prompt_logits
from tests.models.tiny import hf_greedy, hf_logits, hf_prompt_logprobs, on_fake_devices, save_tiny_hf

WINDOW = 8
PROMPTS = [list(range(10, 92)), [3], [(5 * i) % 120 + 1 for i in range(23)]]  # 82 = 10 windows +
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def to_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., out, in] float -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out,
    in/32]): each block's power of two puts its largest value at most 6, each value rounded
    to the nearest FP4 code."""
    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    amax = np.abs(blocks).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    codes = np.abs(np.ldexp(blocks, -exp)[..., None] - MXFP4_VALUES).argmin(-1).astype(np.uint8)
    # Contiguous: safetensors writes an array's buffer as it lies, whatever its strides.
    return (np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)),
            np.ascontiguousarray(exp[..., 0] + 127, np.uint8))


def save_tiny_gpt_oss(out_dir: str) -> tuple[str, str]:
    """(a float checkpoint whose experts hold MXFP4 values, the same stored as MXFP4)."""
    import torch
    import transformers

    from jaxserve.models.checkpoint_quant import dequantize_mxfp4

    base = save_tiny_hf("gpt_oss", os.path.join(out_dir, "base"), initializer_range=0.2,
                        tie_word_embeddings=False, rope_scaling=YARN)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    float_dir = os.path.join(out_dir, "gpt_oss")
    quantized: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                w = p.numpy().swapaxes(1, 2)  # [E, out, in], the checkpoint's order
                blocks, scales = to_mxfp4(w)
                quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
                p.copy_(torch.from_numpy(dequantize_mxfp4(blocks, scales, name, w.shape)
                                         .swapaxes(1, 2).copy()))
    model.save_pretrained(float_dir, safe_serialization=True)
    mx_dir = os.path.join(out_dir, "gpt_oss_mxfp4")
    shutil.copytree(float_dir, mx_dir)
    (file,) = [f for f in os.listdir(mx_dir) if f.endswith(".safetensors")]
    tensors = {k: v for k, v in load_file(os.path.join(mx_dir, file)).items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **quantized}, os.path.join(mx_dir, file), metadata={"format": "pt"})
    with open(os.path.join(mx_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(os.path.join(mx_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return float_dir, mx_dir


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[str, str]:
    return save_tiny_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")))


@pytest.mark.parametrize("experts", [None, WeightFormat.CHECKPOINT_MXFP4,
                                     WeightFormat.CHECKPOINT_MXFP4_PACKED],
                         ids=["dequantized", "fp4", "packed"])
def test_gpt_oss_logits_match_transformers(gpt_oss, experts: WeightFormat | None) -> None:
    """The MXFP4 experts dequantized at load, kept as FP4 values (TPU, CPU) and kept packed
    as stored (GPU): transformers' logits on the dequantized weights."""
    float_dir, mx_dir = gpt_oss
    arch, params = load_checkpoint(mx_dir, np.float32, experts_format=experts)
    assert arch.local_layers == (True, False) and arch.attention_sinks and arch.swiglu_limit == 7.0
    assert arch.rope_scaling.rope_type == "yarn" and not arch.tie_word_embeddings
    w_gate = params["params"]["layers"]["mlp"]["w_gate"]
    if experts is not None:
        assert w_gate["qweight"].dtype.name == experts.values_dtype
        assert w_gate["scale"].dtype == np.uint8  # E8M0 exponents, as stored
    model = LlamaForCausalLM(arch, ModelOptions(experts_format=experts))
    for ids in PROMPTS:
        ours, ref = prompt_logits(model, params, ids), hf_logits(float_dir, ids)
        assert np.abs(ours - ref).max() <= 1e-4
    if experts is not None:
        return
    _, float_params = load_checkpoint(float_dir, np.float32)
    assert np.abs(prompt_logits(model, float_params, PROMPTS[0]) - hf_logits(float_dir, PROMPTS[0])).max() <= 1e-4
    # The sinks matter: without them the logits move.
    layers = params["params"]["layers"]
    no_sinks = {"params": {**params["params"], "layers": {
        **layers, "self_attn": {**layers["self_attn"], "sinks": layers["self_attn"]["sinks"] - 30}}}}
    assert np.abs(prompt_logits(model, no_sinks, PROMPTS[2]) - ref).max() > 1e-2


def test_gpt_oss_through_the_engine(gpt_oss, caplog) -> None:
    """Chunked prefill (8-token steps), the platform's attention kernels with sinks, a
    sliding group giving pages back, preemption in a cache too small for every request, a
    prefix hit, n-gram speculative decoding (looked up from a single token, so there are
    drafts to verify, mostly rejected): transformers' greedy tokens and prompt logprobs."""
    from jaxserve import LLM, SamplingParams

    float_dir, mx_dir = gpt_oss
    caplog.set_level(logging.INFO, logger="jaxserve.engine.build")
    llm = LLM(mx_dir, skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=8, block_size=4, num_gpu_blocks_override=64,
              enforce_eager=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    assert llm.config.resolved.experts_weight_format is WeightFormat.CHECKPOINT_MXFP4
    assert "experts: MXFP4 experts kept as FP4 values" in caplog.messages
    groups = llm.config.resolved.kv_cache_groups
    assert [g.sliding_window for g in groups.groups] == [None, WINDOW]
    prompts = PROMPTS + [list(range(20, 40)) * 4, PROMPTS[0][:60] + [7, 8, 9]]
    want = hf_greedy(float_dir, prompts, 12)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.engine_core.scheduler.make_stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:4]
    assert llm.engine_core.scheduler.total_num_preemptions > 0
    assert llm.engine_core.scheduler.make_stats().spec_decoding_stats.num_drafts > 0
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, use_tqdm=False)
    (out,) = llm.generate([{"prompt_token_ids": prompts[4]}], greedy, use_tqdm=False)
    assert out.num_cached_tokens == 60 and out.outputs[0].token_ids == want[4]
    with_lps = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], with_lps, use_tqdm=False)
    ours = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    assert np.abs(np.asarray(ours) - hf_prompt_logprobs(float_dir, PROMPTS[0])).max() <= 2e-3


def test_gpt_oss_tensor_and_expert_parallel_on_fake_devices(gpt_oss) -> None:
    """Heads and sinks split over 2 devices; the experts split by their intermediate size
    (dequantized at load: 2 devices would split their 3 scale groups), then whole experts
    per device (--enable-expert-parallel), at 4 bits: the same greedy tokens."""
    float_dir, mx_dir = gpt_oss
    res = on_fake_devices(mx_dir, [[2, False], [2, True]], PROMPTS)
    want = hf_greedy(float_dir, PROMPTS, 16)
    assert res["tp2-ep0"]["tokens"] == want and res["tp2-ep1"]["tokens"] == want
    assert res["tp2-ep0"]["experts_dtype"] != "float4_e2m1fn"
    assert res["tp2-ep1"]["experts_dtype"] == "float4_e2m1fn"
    assert res["tp2-ep1"]["w_gate_spec"] == "P(None, 'model', None, None)"  # [L, E, out, in]


def _edit(model_dir: str, out: str, config: dict | None = None,
          tensors: dict[str, np.ndarray] | None = None) -> str:
    shutil.copytree(model_dir, out)
    if config:
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**cfg, **config}, f)
    if tensors:
        (file,) = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        path = os.path.join(out, file)
        save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    return out


def test_gpt_oss_bad_checkpoints_name_the_field(gpt_oss, tmp_path) -> None:
    _, mx_dir = gpt_oss
    name = "model.layers.1.mlp.experts.down_proj"
    blocks = load_file(os.path.join(mx_dir, "model.safetensors"))[f"{name}_blocks"]
    bad = _edit(mx_dir, str(tmp_path / "blocks"), tensors={f"{name}_blocks": blocks[..., :8]})
    with pytest.raises(ValueError, match=f"{name}_blocks.*expected uint8"):
        load_checkpoint(bad, np.float32)
    bad = _edit(mx_dir, str(tmp_path / "sinks"), tensors={
        "model.layers.0.self_attn.sinks": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.sinks.*shape"):
        load_checkpoint(bad, np.float32)
    bad = _edit(mx_dir, str(tmp_path / "types"), config={"sliding_window": None})
    with pytest.raises(ValueError, match="layer_types has sliding_attention layers but sliding_window"):
        load_checkpoint(bad, np.float32)
