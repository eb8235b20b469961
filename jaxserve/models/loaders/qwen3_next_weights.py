"""Hugging Face tensor names -> models/qwen3_next.py's parameter tree (one subtree per layer).

Qwen3.5 stores a linear layer's input projections apart (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`); Qwen3-Next fuses them per key head (`in_proj_qkvz`: for each key
head its q, k, then its value heads' v and z; `in_proj_ba`: its value heads' b, then a). Both
are read into Qwen3.5's layout, so the decoder has one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.models.arch_config import ArchConfig, LinearAttention
from jaxserve.models.loaders.weights import GetTensor, WeightLoadError, fetch


def _split_fused(la: LinearAttention, qkvz: np.ndarray, ba: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused [out, in] projections as Qwen3.5's four."""
    hk, dk, dv = la.num_key_heads, la.key_head_dim, la.value_head_dim
    r = la.num_value_heads // hk
    g = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k = g[:, :dk], g[:, dk:2 * dk]
    v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731  # [heads, rows, in] -> [rows, in]
    gba = ba.reshape(hk, 2 * r, -1)
    return {"in_proj_qkv": np.concatenate([flat(q), flat(k), flat(v)]), "in_proj_z": flat(z),
            "in_proj_b": flat(gba[:, :r]), "in_proj_a": flat(gba[:, r:])}


def _linear_params(cfg: ArchConfig, get: GetTensor, prefix: str, dtype: np.dtype,
                   source: str) -> dict[str, Any]:
    la: LinearAttention = cfg.linear_attention  # type: ignore[assignment]  # a hybrid's
    H, Hv = cfg.hidden_size, la.num_value_heads
    shapes = {"in_proj_qkv": (la.conv_dim, H), "in_proj_z": (la.value_dim, H),
              "in_proj_b": (Hv, H), "in_proj_a": (Hv, H)}
    if get(f"{prefix}.in_proj_qkvz.weight") is not None:  # Qwen3-Next's fused layout
        r = Hv // la.num_key_heads
        qkvz = fetch(get, f"{prefix}.in_proj_qkvz.weight",
                     (2 * la.key_dim + 2 * la.value_dim, H), source)
        ba = fetch(get, f"{prefix}.in_proj_ba.weight", (2 * r * la.num_key_heads, H), source)
        mats = _split_fused(la, qkvz, ba)
    else:
        mats = {n: fetch(get, f"{prefix}.{n}.weight", shape, source) for n, shape in shapes.items()}
    out: dict[str, Any] = {n: {"kernel": np.ascontiguousarray(m.T, dtype)} for n, m in mats.items()}
    conv = fetch(get, f"{prefix}.conv1d.weight", (la.conv_dim, 1, la.conv_kernel), source)
    out["conv1d"] = np.ascontiguousarray(conv[:, 0, :].T, dtype)  # [kernel, conv_dim]
    out["dt_bias"] = np.asarray(fetch(get, f"{prefix}.dt_bias", (Hv,), source), dtype)
    out["A_log"] = np.asarray(fetch(get, f"{prefix}.A_log", (Hv,), source), dtype)
    out["norm"] = np.asarray(fetch(get, f"{prefix}.norm.weight", (la.value_head_dim,), source), dtype)
    out["out_proj"] = {"kernel": np.ascontiguousarray(
        fetch(get, f"{prefix}.out_proj.weight", (H, la.value_dim), source).T, dtype)}
    return out


def _attention_params(cfg: ArchConfig, get: GetTensor, prefix: str, dtype: np.dtype,
                      source: str) -> dict[str, Any]:
    H, Q, KV, D = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    q_rows = 2 * Q if cfg.attn_output_gate else Q
    out: dict[str, Any] = {}
    for name, shape in (("q_proj", (q_rows, H)), ("k_proj", (KV, H)), ("v_proj", (KV, H)),
                        ("o_proj", (H, Q))):
        out[name] = {"kernel": np.ascontiguousarray(
            fetch(get, f"{prefix}.{name}.weight", shape, source).T, dtype)}
    for name in ("q_norm", "k_norm"):
        out[name] = {"scale": np.asarray(fetch(get, f"{prefix}.{name}.weight", (D,), source), dtype)}
    return out


def build_hybrid_params(cfg: ArchConfig, get: GetTensor, dtype: Any, source: str
                        ) -> dict[str, Any]:
    """`{"params": ...}` of NumPy arrays of `dtype` (WeightLoadError naming a missing tensor or
    one of the wrong shape)."""
    dtype = np.dtype(dtype)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    params: dict[str, Any] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        layer: dict[str, Any] = {
            n: {"scale": np.asarray(fetch(get, f"{p}.{n}.weight", (H,), source), dtype)}
            for n in ("input_layernorm", "post_attention_layernorm")}
        if i in cfg.linear_layers:
            if get(f"{p}.self_attn.q_proj.weight") is not None:
                raise WeightLoadError(f"{source}: layer {i} is linear_attention in layer_types "
                                      f"but the checkpoint has {p}.self_attn")
            layer["linear_attn"] = _linear_params(cfg, get, f"{p}.linear_attn", dtype, source)
        else:
            layer["self_attn"] = _attention_params(cfg, get, f"{p}.self_attn", dtype, source)
        layer["mlp"] = {n: {"kernel": np.ascontiguousarray(
            fetch(get, f"{p}.mlp.{n}.weight", shape, source).T, dtype)}
            for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
        params[f"layers_{i}"] = layer
    params["embed_tokens"] = {"embedding": np.asarray(
        fetch(get, "model.embed_tokens.weight", (V, H), source), dtype)}
    params["norm"] = {"scale": np.asarray(fetch(get, "model.norm.weight", (H,), source), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": np.ascontiguousarray(
            fetch(get, "lm_head.weight", (V, H), source).T, dtype)}
    return {"params": params}
