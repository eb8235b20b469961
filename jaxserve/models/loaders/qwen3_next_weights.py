"""Hugging Face tensor names -> models/qwen3_next.py's parameter tree (one subtree per layer).

Qwen3.5 stores a linear layer's input projections apart (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`); Qwen3-Next fuses them per key head (`in_proj_qkvz`: for each key
head its q, k, then its value heads' v and z; `in_proj_ba`: its value heads' b, then a). Both
are read into Qwen3.5's layout, so the decoder has one. The MoE forms' experts are one
[out, in] tensor per expert (`mlp.experts.{e}.gate_proj`, as published) or transformers' fused
stacks (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.models.arch_config import ArchConfig, LinearAttention
from jaxserve.models.loaders.weights import GetTensor, WeightLoadError, fetch


def _kernel(get: GetTensor, name: str, shape: tuple[int, int], dtype: np.dtype, source: str
            ) -> dict[str, np.ndarray]:
    """A Dense's params from an HF [out, in] weight."""
    return {"kernel": np.ascontiguousarray(fetch(get, name, shape, source).T, dtype)}


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
    out["out_proj"] = _kernel(get, f"{prefix}.out_proj.weight", (H, la.value_dim), dtype, source)
    return out


def _attention_params(cfg: ArchConfig, get: GetTensor, prefix: str, dtype: np.dtype,
                      source: str) -> dict[str, Any]:
    H, Q, KV, D = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    q_rows = 2 * Q if cfg.attn_output_gate else Q
    out: dict[str, Any] = {}
    for name, shape in (("q_proj", (q_rows, H)), ("k_proj", (KV, H)), ("v_proj", (KV, H)),
                        ("o_proj", (H, Q))):
        out[name] = _kernel(get, f"{prefix}.{name}.weight", shape, dtype, source)
    for name in ("q_norm", "k_norm"):
        out[name] = {"scale": np.asarray(fetch(get, f"{prefix}.{name}.weight", (D,), source), dtype)}
    return out


def _swiglu_params(get: GetTensor, prefix: str, H: int, I: int, dtype: np.dtype, source: str
                   ) -> dict[str, Any]:
    return {n: _kernel(get, f"{prefix}.{n}.weight", shape, dtype, source)
            for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}


def _sparse_params(cfg: ArchConfig, get: GetTensor, prefix: str, dtype: np.dtype, source: str
                   ) -> dict[str, Any]:
    """A sparse layer's feed-forward: the router and the experts stacked as moe.py's MoE
    reads them (w_gate, w_up [E, H, I], w_down [E, I, H]), and the shared expert if any."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    experts: dict[str, np.ndarray] = {
        "gate": np.ascontiguousarray(fetch(get, f"{prefix}.gate.weight", (E, H), source).T, dtype)}
    if get(f"{prefix}.experts.gate_up_proj") is not None:  # transformers' fused stacks
        gate_up = fetch(get, f"{prefix}.experts.gate_up_proj", (E, 2 * I, H), source)
        down = fetch(get, f"{prefix}.experts.down_proj", (E, H, I), source)
        experts["w_gate"] = np.ascontiguousarray(gate_up[:, :I].transpose(0, 2, 1), dtype)
        experts["w_up"] = np.ascontiguousarray(gate_up[:, I:].transpose(0, 2, 1), dtype)
        experts["w_down"] = np.ascontiguousarray(down.transpose(0, 2, 1), dtype)
    else:
        for name, hf, shape in (("w_gate", "gate_proj", (I, H)), ("w_up", "up_proj", (I, H)),
                                ("w_down", "down_proj", (H, I))):
            experts[name] = np.stack([
                fetch(get, f"{prefix}.experts.{e}.{hf}.weight", shape, source).T
                for e in range(E)]).astype(dtype)
    out: dict[str, Any] = {"experts": experts}
    S = cfg.shared_expert_intermediate_size
    if S:
        out["shared_expert"] = _swiglu_params(get, f"{prefix}.shared_expert", H, S, dtype, source)
        out["shared_expert_gate"] = _kernel(get, f"{prefix}.shared_expert_gate.weight", (1, H),
                                            dtype, source)
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
        if cfg.is_moe_layer(i):
            layer["mlp"] = _sparse_params(cfg, get, f"{p}.mlp", dtype, source)
        else:
            layer["mlp"] = _swiglu_params(get, f"{p}.mlp", H, I, dtype, source)
        params[f"layers_{i}"] = layer
    params["embed_tokens"] = {"embedding": np.asarray(
        fetch(get, "model.embed_tokens.weight", (V, H), source), dtype)}
    params["norm"] = {"scale": np.asarray(fetch(get, "model.norm.weight", (H,), source), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = _kernel(get, "lm_head.weight", (V, H), dtype, source)
    return {"params": params}
