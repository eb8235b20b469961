"""Hugging Face tensor names -> the decoder's stacked parameter tree.

Every loader (HF safetensors, GGUF, Orbax) ends here: it hands over a function
that returns one tensor by its Hugging Face name, and this module stacks the
per-layer tensors, transposes projections to `[in, out]`, casts to the target
dtype and checks every shape, naming the file and tensor when one is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.config import WeightFormat
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.architectures import ARCHITECTURES
from jaxserve.models.checkpoint_quant import CheckpointQuant, read_matrix

GetTensor = Callable[[str], np.ndarray | None]  # HF name -> array, or None if absent


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, corrupt or of the wrong shape."""


# (HF suffix, param path inside `layers`, transpose, expected HF shape)
_LayerRow = tuple[str, tuple[str, ...], bool, tuple[int, ...]]


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """A projection's [out, in] shape (the table's kernels are matrices)."""
    n_out, n_in = shape
    return n_out, n_in


def _layer_table(cfg: ArchConfig) -> list[_LayerRow]:
    """(HF suffix, param path inside `layers`, transpose, expected HF shape)."""
    H, I, Q, KV, D = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    rows: list[_LayerRow] = [
        ("input_layernorm.weight", ("input_layernorm", "scale"), False, (H,)),
        ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), False, (H,)),
        ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), True, (Q, H)),
        ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), True, (KV, H)),
        ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), True, (KV, H)),
        ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), True, (H, Q)),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), True, (I, H)),
        ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), True, (I, H)),
        ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), True, (H, I)),
    ]
    if cfg.num_experts:  # the router here; the experts are stacked by _expert_params
        E = cfg.num_experts
        router: list[_LayerRow] = [(f"{_moe_prefix(cfg)}.gate.weight", ("mlp", "gate"), True, (E, H))]
        if _gpt_oss(cfg):
            router = [("mlp.router.weight", ("mlp", "gate"), True, (E, H)),
                      ("mlp.router.bias", ("mlp", "gate_bias"), False, (E,))]
        # Dense layers among the sparse: both, each stacked over its own layers (_row_layers).
        rows = rows + router if cfg.moe_layers is not None else rows[:-3] + router
    if cfg.attention_sinks:
        rows.append(("self_attn.sinks", ("self_attn", "sinks"), False, (cfg.num_attention_heads,)))
    if cfg.o_proj_bias:
        rows.append(("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), False, (H,)))
    if cfg.gemma:  # the feed-forward's own sandwich norms
        rows += [(f"{n}.weight", (n, "scale"), False, (H,))
                 for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]
    if cfg.attention_bias:
        rows += [
            ("self_attn.q_proj.bias", ("self_attn", "q_proj", "bias"), False, (Q,)),
            ("self_attn.k_proj.bias", ("self_attn", "k_proj", "bias"), False, (KV,)),
            ("self_attn.v_proj.bias", ("self_attn", "v_proj", "bias"), False, (KV,)),
        ]
    if cfg.qk_norm:
        rows += [
            ("self_attn.q_norm.weight", ("self_attn", "q_norm", "scale"), False, (D,)),
            ("self_attn.k_norm.weight", ("self_attn", "k_norm", "scale"), False, (D,)),
        ]
    return rows


def _row_layers(cfg: ArchConfig, path: tuple[str, ...]) -> list[int]:
    """The layers a table row is stacked over (ArchConfig.stack_layers for the MLP's)."""
    if path[0] != "mlp":
        return list(range(cfg.num_hidden_layers))
    return cfg.stack_layers(path[1])


def _gpt_oss(cfg: ArchConfig) -> bool:
    return ARCHITECTURES[cfg.architecture].experts == "gpt_oss"


def _moe_prefix(cfg: ArchConfig) -> str:
    return "block_sparse_moe" if ARCHITECTURES[cfg.architecture].experts == "mixtral" else "mlp"


# param name -> (Mixtral's HF name, Qwen3-MoE's): each expert's [out, in] matrix.
_EXPERT_NAMES = {"w_gate": ("w1", "gate_proj"), "w_up": ("w3", "up_proj"),
                 "w_down": ("w2", "down_proj")}


def _expert_params(cfg: ArchConfig, get: GetTensor, dtype: Any, source: str,
                   stored: Callable[[str, tuple[int, int]], dict[str, np.ndarray]] | None = None,
                   experts_format: WeightFormat | None = None) -> dict[str, Any]:
    """Every sparse layer's experts stacked [L, E, in, out] (w_gate, w_up: [.., H, I];
    w_down: [.., I, H]) from one [out, in] tensor per expert; with `stored` (a checkpoint's
    own format: HF module name, shape -> leaves) each leaf stacked [L, E, out, ...]."""
    if _gpt_oss(cfg):
        if stored is not None:
            raise ValueError(f"{source}: GPT-OSS's experts are read as float or MXFP4")
        return _gpt_oss_experts(cfg, get, dtype, source, experts_format)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layers = _row_layers(cfg, ("mlp", "w_gate"))
    mixtral = ARCHITECTURES[cfg.architecture].experts == "mixtral"
    out: dict[str, Any] = {}
    for name, hf_names in _EXPERT_NAMES.items():
        shape = (H, I) if name == "w_down" else (I, H)
        hf = [[f"model.layers.{i}.{_moe_prefix(cfg)}.experts.{e}.{hf_names[not mixtral]}.weight"
               for e in range(E)] for i in layers]
        if stored is not None:
            leaves = [[stored(n.removesuffix(".weight"), shape) for n in row] for row in hf]
            out[name] = {k: np.stack([np.stack([t[k] for t in row]) for row in leaves])
                         for k in leaves[0][0]}
            continue
        stacked = np.empty((len(layers), E, shape[1], shape[0]), dtype)
        for j, row in enumerate(hf):
            for e, n in enumerate(row):
                stacked[j, e] = fetch(get, n, shape, source).T
        out[name] = stacked
    return out


def _gpt_oss_experts(cfg: ArchConfig, get: GetTensor, dtype: Any, source: str,
                     fmt: WeightFormat | None) -> dict[str, Any]:
    """GPT-OSS's experts, stacked [L, E, ...] as _expert_params' and their biases (b_gate,
    b_up [L, E, I], b_down [L, E, H]), from each layer's fused tensors: `gate_up_proj`
    [E, H, 2I] (gate and up interleaved: columns 0, 2, .. are the gate's) and `down_proj`
    [E, I, H], or their MXFP4 `_blocks` / `_scales` ([E, out, in] quantized), dequantized here
    once, one layer at a time; with an MXFP4 `fmt` kept at 4 bits: `qweight` FP4 values
    [L, E, out, in] and `scale` uint8 [L, E, out, in / 32] as stored (models/moe.py's
    Int8Stack), or packed, the checkpoint's bytes: `qweight` uint8 [L, E, out, in / 2]."""
    import ml_dtypes

    from jaxserve.models.checkpoint_quant import check_mxfp4, dequantize_mxfp4, unpack_mxfp4

    E, H, I, L = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_hidden_layers
    mxfp4 = fmt is not None and fmt.mxfp4

    def quantized(prefix: str, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray] | None:
        names = (f"{prefix}_blocks", f"{prefix}_scales")
        blocks, scales = get(names[0]), get(names[1])
        if blocks is None and not mxfp4:
            return None
        if blocks is None or scales is None:
            missing = names[0] if blocks is None else names[1]
            raise WeightLoadError(f"{source}: tensor {missing!r} is missing")
        return blocks, scales

    def matrix(prefix: str, n_in: int, n_out: int) -> Any:
        """[E, n_in, n_out] float, or with `mxfp4` (values [E, n_out, n_in], scales)."""
        q = quantized(prefix, n_in, n_out)
        if q is None:
            return fetch(get, prefix, (E, n_in, n_out), source)
        if fmt is WeightFormat.CHECKPOINT_MXFP4_PACKED:
            check_mxfp4(*q, prefix, (E, n_out, n_in))
            return q[0].reshape(E, n_out, n_in // 2), q[1]
        if mxfp4:  # float4 values, the scales as stored
            values = unpack_mxfp4(*q, prefix, (E, n_out, n_in))[0]
            return values.astype(ml_dtypes.float4_e2m1fn), q[1]
        return dequantize_mxfp4(*q, prefix, (E, n_out, n_in)).swapaxes(1, 2)

    def rows(m: Any, part: slice) -> Any:  # the gate's or up's outputs of gate_up
        return tuple(a[:, part] for a in m) if mxfp4 else m[..., part]

    out: dict[str, Any] = {}

    def put(name: str, i: int, value: Any) -> None:
        """Layer i's leaf (or MXFP4 leaves) into its [L, ...] stack, made at the first layer:
        only one layer is ever float32 at once."""
        leaves = dict(zip(("qweight", "scale"), value)) if isinstance(value, tuple) else {
            None: np.asarray(value, dtype)}
        if name not in out:
            made = {k: np.empty((L, *v.shape), v.dtype) for k, v in leaves.items()}
            out[name] = made[None] if None in made else made
        for k, v in leaves.items():
            (out[name] if k is None else out[name][k])[i] = v

    for i in range(L):
        p = f"model.layers.{i}.mlp.experts"
        gate_up = matrix(f"{p}.gate_up_proj", H, 2 * I)
        put("w_gate", i, rows(gate_up, slice(0, None, 2)))
        put("w_up", i, rows(gate_up, slice(1, None, 2)))
        put("w_down", i, matrix(f"{p}.down_proj", I, H))
        bias = fetch(get, f"{p}.gate_up_proj_bias", (E, 2 * I), source)
        put("b_gate", i, bias[:, 0::2])
        put("b_up", i, bias[:, 1::2])
        put("b_down", i, fetch(get, f"{p}.down_proj_bias", (E, H), source))
    return out


def projection_shapes(cfg: ArchConfig) -> dict[str, tuple[int, int]]:
    """Every projection's HF weight name -> its [out, in] shape (the layers', each expert's
    and a separate LM head's): the matrices a quantized checkpoint may store quantized."""
    shapes = {}
    for suffix, path, transpose, shape in _layer_table(cfg):
        if transpose and path[-1] == "kernel":
            shapes.update({f"model.layers.{i}.{suffix}": _matrix(shape) for i in _row_layers(cfg, path)})
    if cfg.num_experts:
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        mixtral = ARCHITECTURES[cfg.architecture].experts == "mixtral"
        for name, hf_names in _EXPERT_NAMES.items():
            shape = (H, I) if name == "w_down" else (I, H)
            for i in _row_layers(cfg, ("mlp", "w_gate")):
                shapes.update({f"model.layers.{i}.{_moe_prefix(cfg)}.experts.{e}.{hf_names[not mixtral]}"
                               f".weight": shape for e in range(E)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


# Phi-3 fuses q/k/v and gate/up: (name the table reads, fused name, which part).
_FUSED = (("self_attn.q_proj", "self_attn.qkv_proj", 0), ("self_attn.k_proj", "self_attn.qkv_proj", 1),
          ("self_attn.v_proj", "self_attn.qkv_proj", 2), ("mlp.gate_proj", "mlp.gate_up_proj", 0),
          ("mlp.up_proj", "mlp.gate_up_proj", 1))


def _split_fused(cfg: ArchConfig, get: GetTensor) -> GetTensor:
    """`get` with Phi-3's fused `qkv_proj` [Q + 2 KV, H] and `gate_up_proj` [2 I, H] read as
    the separate projections (rows split at load; other checkpoints pass through)."""
    if not ARCHITECTURES[cfg.architecture].fused_projections:
        return get
    Q, KV, I = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    bounds = {"self_attn.qkv_proj": (0, Q, Q + KV, Q + 2 * KV), "mlp.gate_up_proj": (0, I, 2 * I)}

    def fused_get(name: str) -> np.ndarray | None:
        for part, fused, i in _FUSED:
            if name.endswith(f".{part}.weight"):
                t = get(name.replace(part, fused))
                if t is None:
                    return None
                lo, hi = bounds[fused][i], bounds[fused][i + 1]
                if t.shape[0] != bounds[fused][-1]:
                    return t  # the shape check names it
                return np.ascontiguousarray(t[lo:hi])
        return get(name)

    return fused_get


def fetch(get: GetTensor, name: str, shape: tuple[int, ...], source: str) -> np.ndarray:
    """Tensor `name`, checked present, of `shape` and float (WeightLoadError naming it)."""
    t = get(name)
    if t is None:
        raise WeightLoadError(f"{source}: tensor {name!r} is missing")
    if tuple(t.shape) != shape:
        raise WeightLoadError(
            f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
        )
    if not np.issubdtype(t.dtype, np.floating) and t.dtype.name != "bfloat16":
        raise WeightLoadError(f"{source}: tensor {name!r} has non-float dtype {t.dtype}")
    return t


def _fetch_quantized(get: GetTensor, name: str, shape: tuple[int, int], source: str,
                     fmt: WeightFormat) -> dict[str, np.ndarray]:
    """One [out, in] matrix converted to `fmt` at once (models/quantization.py),
    so only this tensor is ever float."""
    from jaxserve.models.quantization import quantize_weight

    return quantize_weight(fetch(get, name, shape, source), fmt, in_axis=-1)


def build_params(
    cfg: ArchConfig, get: GetTensor, dtype: Any, source: str,
    weight_format: WeightFormat = WeightFormat.FLOAT, stored: CheckpointQuant | None = None,
    experts_format: WeightFormat | None = None,
) -> dict[str, Any]:
    """Assemble the Flax param tree `{"params": ...}` as NumPy arrays of `dtype`.

    With a quantized `weight_format` (int8, bf16) every projection and the embedding arrive in that
    format one tensor at a time (`qweight` [out, in], int8's `scale`), so the whole model
    never exists in float32. A checkpoint's own format (`weight_format.from_checkpoint`)
    reads every layer projection as the checkpoint's scheme `stored` keeps it; the embedding
    and LM head stay float.

    NOTE: leaves are plain `np.ndarray`s (never views of a memory-mapped file):
    multi-host `device_put` accepts only exact host array types.
    """
    dtype = np.dtype(dtype)
    if cfg.linear_attention is not None:  # a Gated DeltaNet hybrid: a layer tree of its own
        from jaxserve.models.loaders.qwen3_next_weights import build_hybrid_params

        if weight_format is not WeightFormat.FLOAT or stored is not None:
            raise ValueError(f"{source}: {cfg.architecture} is read as float weights only so far")
        return build_hybrid_params(cfg, get, dtype, source)
    raw_get, get = get, _split_fused(cfg, get)
    read_stored: Callable[[str, tuple[int, int]], dict[str, np.ndarray]] | None = None
    if weight_format.from_checkpoint:
        if stored is None:
            raise ValueError(f"{weight_format.value} weights need the checkpoint's scheme")
        if stored.desc_act and cfg.num_experts:  # the experts' stacks have no `perm`
            raise ValueError(f"{source}: {stored.name} with desc_act experts are read dequantized only")

        def read_module(module: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
            leaves = read_matrix(stored, raw_get, module, shape, source).as_leaves(
                weight_format.values_dtype, weight_format.zero_points, stored.desc_act)
            if "zero_scale" in leaves:  # a float leaf: the model's dtype
                leaves["zero_scale"] = leaves["zero_scale"].astype(dtype)
            return leaves
        read_stored = read_module
    layers: dict[str, Any] = {}
    for suffix, path, transpose, shape in _layer_table(cfg):
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        rows = _row_layers(cfg, path)
        if read_stored is not None and path[-1] == "kernel":
            per_layer = [read_stored(f"model.layers.{i}.{suffix}".removesuffix(".weight"), _matrix(shape))
                         for i in rows]
            node.update({k: np.stack([t[k] for t in per_layer]) for k in per_layer[0]})
            continue
        if weight_format.quantized and path[-1] == "kernel":
            per_layer = [_fetch_quantized(get, f"model.layers.{i}.{suffix}", _matrix(shape), source,
                                          weight_format)
                         for i in rows]
            node.update({k: np.stack([t[k] for t in per_layer]) for k in per_layer[0]})
            continue
        out_shape = shape[::-1] if transpose else shape
        stacked = np.empty((len(rows), *out_shape), dtype)
        for j, i in enumerate(rows):
            t = fetch(get, f"model.layers.{i}.{suffix}", shape, source)
            stacked[j] = t.T if transpose else t
        node[path[-1]] = stacked
    if cfg.num_experts:
        mxfp4 = experts_format is not None and experts_format.mxfp4
        experts = _expert_params(cfg, get, dtype, source, read_stored, experts_format)
        if weight_format.quantized and read_stored is None and not mxfp4:  # one stack at a time in float, then quantized
            from jaxserve.models.quantization import check_experts, quantize_weight

            check_experts(weight_format)
            for name, w in experts.items():
                if name in _EXPERT_NAMES:  # not GPT-OSS's biases
                    experts[name] = quantize_weight(w, weight_format, in_axis=-2)
        layers["mlp"].update(experts)
    V, H = cfg.vocab_size, cfg.hidden_size
    if read_stored is not None:  # the checkpoint's float embedding and LM head
        weight_format = WeightFormat.FLOAT
    if weight_format.quantized:
        embed = _fetch_quantized(get, "model.embed_tokens.weight", (V, H), source, weight_format)
    else:
        embed = {"embedding": np.asarray(fetch(get, "model.embed_tokens.weight", (V, H), source), dtype)}
    params: dict[str, Any] = {
        "embed_tokens": embed,
        "layers": layers,
        "norm": {"scale": np.asarray(fetch(get, "model.norm.weight", (H,), source), dtype)},
    }
    if not cfg.tie_word_embeddings and weight_format.quantized:
        params["lm_head"] = _fetch_quantized(get, "lm_head.weight", (V, H), source, weight_format)
    elif not cfg.tie_word_embeddings:
        head = fetch(get, "lm_head.weight", (V, H), source)
        params["lm_head"] = {"kernel": np.ascontiguousarray(head.T, dtype)}
    return {"params": params}
