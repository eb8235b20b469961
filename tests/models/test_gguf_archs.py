"""GGUF files of the newer architectures: a tiny transformers checkpoint written as llama.cpp's
converter writes it (its tensor names from the gguf package, experts stacked [E, out, in],
Gemma's norms stored as 1 + w, q/k rows permuted for "llama", LongRoPE factors as tensors),
read back by jaxserve and compared with transformers in float32."""

from __future__ import annotations

import dataclasses
import math
import os

import gguf
import numpy as np
import pytest

from jaxserve.models import LlamaForCausalLM
from jaxserve.models.loaders import load_checkpoint
from tests.models.forward import prompt_logits
from tests.models.test_gemma import GEMMA3_TYPES
from tests.models.test_gemma import KINDS as GEMMA_KINDS
from tests.models.test_gguf_loader import llama_cpp_permute
from tests.models.tiny import hf_logits, save_tiny_hf

PROMPTS = [list(range(10, 60)), [3], [(5 * i) % 120 + 1 for i in range(23)]]
ROPE_D = 6  # Phi-4-mini-like: rope on 12 of 16 dims per head


def tiny(kind: str, out_dir: str) -> str:
    if kind in ("gemma2", "gemma3"):
        # GGUF keeps no query_pre_attn_scalar: llama.cpp uses head_dim (all but the 27Bs).
        return save_tiny_hf(kind, out_dir, initializer_range=0.2, query_pre_attn_scalar=16,
                            **GEMMA_KINDS[kind])
    if kind == "phi3":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(ROPE_D)],
                "long_factor": [1.0 + 2.0 * i for i in range(ROPE_D)]}
        return save_tiny_hf("phi3", out_dir, head_dim=16, rope_scaling=rope,
                            partial_rotary_factor=0.75, max_position_embeddings=128,
                            original_max_position_embeddings=32, sliding_window=16,
                            tie_word_embeddings=False)
    return save_tiny_hf(kind, out_dir)


def write_gguf(model_dir: str, path: str, kind: str) -> None:
    """`model_dir` as llama.cpp's convert_hf_to_gguf.py would write it (written here from its
    documented layout, float32 tensors)."""
    import json

    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    arch = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}.get(kind, kind)
    L, H, heads, kv = (cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                         "num_key_value_heads"))
    head_dim = cfg.get("head_dim") or H // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if kind == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in GEMMA3_TYPES])
    else:
        w.add_rope_freq_base(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0))
    if kind in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(cfg["sliding_window"])
    if kind == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if kind == "phi3":
        orig, max_pos = cfg["original_max_position_embeddings"], cfg["max_position_embeddings"]
        w.add_rope_dimension_count(2 * ROPE_D)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(max_pos / orig) / math.log(orig)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], L)
    stacks: dict[str, list[np.ndarray]] = {}
    for name, t in sd.items():
        if ".experts." in name:  # ...experts.{e}.{w1|gate_proj|...}.weight -> blk.i.ffn_*_exps
            layer = name.split(".")[2]
            which = name.split(".")[-2]
            part = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(which, "down")
            stacks.setdefault(f"blk.{layer}.ffn_{part}_exps.weight", []).append(
                (int(name.split(".")[-3]), t))
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if kind in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp's Gemma graph multiplies by the stored weight
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, kv)
        w.add_tensor(gname, np.ascontiguousarray(t, np.float32))
    for gname, parts in stacks.items():
        w.add_tensor(gname, np.stack([t for _, t in sorted(parts, key=lambda p: p[0])]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3"])
def test_gguf_of_newer_architectures_matches_transformers(kind: str, tmp_path) -> None:
    model_dir = tiny(kind, str(tmp_path))
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(model_dir, path, kind)
    hf_arch, _ = load_checkpoint(model_dir, np.float32)
    arch, params = load_checkpoint(path, np.float32)
    # The metadata gives the architecture the config gives (but eos/bos: no tokenizer here;
    # Phi-3's attention factor, stored by the converter where the config derives it).
    assert arch.rms_norm_eps == pytest.approx(hf_arch.rms_norm_eps)  # a float32 in GGUF
    strip = dict(bos_token_id=None, eos_token_id=None, rms_norm_eps=hf_arch.rms_norm_eps)
    if kind == "phi3":
        assert arch.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
        strip["rope_scaling"] = hf_arch.rope_scaling
    assert dataclasses.replace(arch, **strip) == dataclasses.replace(hf_arch, **strip), kind
    model = LlamaForCausalLM(arch)
    for ids in PROMPTS:
        ours, ref = prompt_logits(model, params, ids), hf_logits(model_dir, ids)
        assert np.abs(ours - ref).max() <= 1e-4, kind
