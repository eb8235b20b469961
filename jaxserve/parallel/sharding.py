"""Tensor-parallel sharding, declared once: logical axes per weight, rules to mesh axes.

    logical axis   mesh axis   what it splits
    vocab          model       embedding rows / LM-head columns (vocab-parallel)
    heads          model       q/k/v output columns, o_proj input rows (column / row parallel)
    mlp            model       gate/up output columns, down_proj input rows
    kv_slots       model       a token's KV-cache entries by head: [2*kvh, D] rows, or the
                               TPU's packed words (whole heads per device either way)
    expert_mlp     model       each expert's intermediate columns (mixture of experts)
    experts        model       whole experts instead, with --enable-expert-parallel
    layers, embed, head_dim    (replicated)

Head counts that the tensor-parallel degree does not divide (SmolLM2-135M has 9
query heads in 3 KV groups) are made divisible before sharding:

  * replicate: when tp is a multiple of the KV heads and each group's query heads
    split evenly, every KV head is copied tp / kv_heads times and its query
    group split among the copies (no extra work);
  * pad: otherwise dummy KV groups are appended (zero K/V weights, zero o_proj
    rows), so they add nothing to the output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.models.arch_config import ArchConfig

LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "mlp": "model",
    "kv_slots": "model",
    "layers": None,
    "embed": None,
    "head_dim": None,
    # A mixture of experts: each expert's intermediate columns over "model" (as the dense
    # MLP's), or with expert parallelism whole experts (EXPERT_PARALLEL_RULES).
    "experts": None,
    "expert_mlp": "model",
}
EXPERT_PARALLEL_RULES = {**LOGICAL_RULES, "experts": "model", "expert_mlp": None}

# Param path (inside "params") -> logical axes of the leaf.
# A leaf's logical axis names, one per dimension (None: an axis never split).
LogicalAxes = tuple[str | None, ...]

PARAM_AXES: dict[tuple[str, ...], LogicalAxes] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("norm", "scale"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("layers", "input_layernorm", "scale"): ("layers", "embed"),
    ("layers", "post_attention_layernorm", "scale"): ("layers", "embed"),
    ("layers", "self_attn", "q_proj", "kernel"): ("layers", "embed", "heads"),
    ("layers", "self_attn", "k_proj", "kernel"): ("layers", "embed", "heads"),
    ("layers", "self_attn", "v_proj", "kernel"): ("layers", "embed", "heads"),
    ("layers", "self_attn", "q_proj", "bias"): ("layers", "heads"),
    ("layers", "self_attn", "k_proj", "bias"): ("layers", "heads"),
    ("layers", "self_attn", "v_proj", "bias"): ("layers", "heads"),
    ("layers", "self_attn", "o_proj", "kernel"): ("layers", "heads", "embed"),
    ("layers", "self_attn", "q_norm", "scale"): ("layers", "head_dim"),
    ("layers", "self_attn", "k_norm", "scale"): ("layers", "head_dim"),
    ("layers", "mlp", "gate_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "mlp", "up_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "mlp", "down_proj", "kernel"): ("layers", "mlp", "embed"),
    ("layers", "pre_feedforward_layernorm", "scale"): ("layers", "embed"),  # Gemma
    ("layers", "post_feedforward_layernorm", "scale"): ("layers", "embed"),
    ("layers", "mlp", "gate"): ("layers", "embed", None),  # the MoE router
    ("layers", "mlp", "w_gate"): ("layers", "experts", "embed", "expert_mlp"),
    ("layers", "mlp", "w_up"): ("layers", "experts", "embed", "expert_mlp"),
    ("layers", "mlp", "w_down"): ("layers", "experts", "expert_mlp", "embed"),
    # GPT-OSS: sinks per q head, o_proj's bias, the router's and the experts' biases (the
    # down bias is added outside the experts' shard_map, whole: models/moe.py)
    ("layers", "self_attn", "sinks"): ("layers", "heads"),
    ("layers", "self_attn", "o_proj", "bias"): ("layers", "embed"),
    ("layers", "mlp", "gate_bias"): ("layers", None),
    ("layers", "mlp", "b_gate"): ("layers", "experts", "expert_mlp"),
    ("layers", "mlp", "b_up"): ("layers", "experts", "expert_mlp"),
    ("layers", "mlp", "b_down"): ("layers", None, "embed"),
    # int8 experts: [out, in] per expert, scales split as their weights
    **{("layers", "mlp", w, leaf): ("layers", "experts", *axes)
       for w, axes in (("w_gate", ("expert_mlp", "embed")), ("w_up", ("expert_mlp", "embed")),
                       ("w_down", ("embed", "expert_mlp")))
       for leaf in ("qweight", "scale")},
}

def _quantized_axes(axes: dict[tuple[str, ...], LogicalAxes]) -> dict[tuple[str, ...], LogicalAxes]:
    """Rules for int8 and bf16 weights (models/quantization.py): `qweight` is the float kernel
    transposed to [out, in] (the embedding keeps its [vocab, embed]); `scale`, `zero_scale` [out, groups]
    split as `qweight` does (a group of inputs stays on the device holding its inputs);
    packed bf16 weights (`packed`) stay whole."""
    out: dict[tuple[str, ...], LogicalAxes] = {}
    for path, ax in axes.items():
        if path[-1] == "kernel":
            *lead, inp, outp = ax
            for leaf in ("qweight", "scale", "zero_scale"):
                out[(*path[:-1], leaf)] = (*lead, outp, inp)
            out[(*path[:-1], "perm")] = (*lead, None)  # act order: one device per stage only
        elif path == ("embed_tokens", "embedding"):
            out[("embed_tokens", "qweight")] = out[("embed_tokens", "scale")] = ax
        # Packed bf16 (the CPU, one device per stage): oneDNN's opaque [..., S] blocks, whole.
        if path[-1] == "kernel" or path == ("embed_tokens", "embedding"):
            out[(*path[:-1], "packed")] = ("layers", None) if path[0] == "layers" else (None,)
    return out


PARAM_AXES.update(_quantized_axes(PARAM_AXES))
# [L, pages, page, 2*kvh, D] (standard) or [L, pages, page, R*W] (packed; see kernels_pallas)
KV_CACHE_AXES = ("layers", None, None, "kv_slots", "head_dim")


def logical_to_spec(axes: LogicalAxes, shape: tuple[int, ...], mesh: Mesh,
                    rules: dict[str, str | None] | None = None) -> PartitionSpec:
    """Map logical axes to mesh axes; a dimension the mesh axis does not divide stays whole."""
    spec = []
    for name, dim in zip(axes, shape):
        mesh_axis = (rules or LOGICAL_RULES).get(name) if name else None
        if mesh_axis is not None and dim % mesh.shape[mesh_axis] != 0:
            mesh_axis = None
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def param_shardings(params: dict[str, Any], mesh: Mesh, expert_parallel: bool = False
                    ) -> dict[str, Any]:
    """NamedSharding for every leaf of `{"params": ...}` (`expert_parallel`: whole experts
    per device)."""
    rules = EXPERT_PARALLEL_RULES if expert_parallel else LOGICAL_RULES

    def one(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        keys = tuple(p.key for p in path)[1:]  # drop the leading "params"
        axes = PARAM_AXES.get(keys)
        if axes is None and keys[0].startswith("layers_"):
            # A Gated DeltaNet hybrid's layer (models/qwen3_next.py: one subtree per layer, no
            # layer axis): the stacked layers' rule without it (its routed experts' as the
            # MoE's, its shared expert's as a dense MLP's); its linear attention and the shared
            # expert's gate whole (one device so far: engine/resolve.py refuses tensor
            # parallelism for them).
            rest = keys[1:]
            if rest[:2] in (("mlp", "experts"), ("mlp", "shared_expert")):
                rest = ("mlp", *rest[2:])
            stacked = PARAM_AXES.get(("layers", *rest))
            whole = keys[1] == "linear_attn" or rest[:2] == ("mlp", "shared_expert_gate")
            axes = stacked[1:] if stacked else ((None,) * leaf.ndim if whole else None)
        if axes is None:
            raise KeyError(f"no sharding rule for parameter {'/'.join(keys)}")
        return NamedSharding(mesh, logical_to_spec(axes, leaf.shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, params)


# Weights a device's compiled programs read in another layout than the one its runtime gives
# a parameter by default, by device_kind: {(ndim, dtype): tiling}, row-major. tpu7x reads a
# stacked bf16 weight ([layers, ...], scanned) in (16, 128) tiles; handed (8, 128), its forward
# copied every stack whole at each step. Its default for a 2-D bf16 parameter is column-major,
# so the embedding was copied to row-major for the token gather at each step too
# (docs/benchmarks.md, "The tpu7x weight copy"; scripts/tpu_weight_tiling.py). v5e and v6e
# read the defaults; int8 stacks are not copied on any of the three.
WEIGHT_TILINGS: dict[str, dict[tuple[int, str], tuple[tuple[int, ...], ...]]] = {
    "TPU7x": {(2, "bfloat16"): ((8, 128), (2, 1)), (3, "bfloat16"): ((16, 128), (2, 1)),
              (4, "bfloat16"): ((16, 128), (2, 1))},
}


def weight_placements(params: Any, shardings: Any) -> Any:
    """`shardings` (param_shardings') with a device-local layout (a `Format`) for each weight
    the devices read in another layout than their default (WEIGHT_TILINGS): for
    `jax.device_put` at load and for the preflight's abstract params alike."""
    def one(leaf: Any, sharding: NamedSharding) -> NamedSharding | Format:
        tilings = WEIGHT_TILINGS.get(sharding.mesh.devices.flat[0].device_kind, {})
        tiling = tilings.get((len(leaf.shape), np.dtype(leaf.dtype).name))
        # Only stacks that fill a tile: a smaller one (GPT-OSS's sinks [L, 64], its experts'
        # down bias [L, 8, H] in a small config) is no copy worth avoiding, and tpu7x's
        # compiler failed on such layouts (a shape mismatch, a crash).
        if tiling is None or any(d < t for d, t in zip(leaf.shape[-2:], tiling[0])):
            return sharding
        return Format(Layout(major_to_minor=tuple(range(len(leaf.shape))), tiling=tiling), sharding)

    return jax.tree.map(one, params, shardings)


def kv_cache_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(KV_CACHE_AXES, shape, mesh))


@dataclass(frozen=True)
class HeadLayout:
    num_kv_heads: int  # after replication / padding
    num_q_heads: int
    replicas: int  # copies of each original KV head (1 = none)
    padded_groups: int  # dummy KV groups appended


def head_layout(arch: ArchConfig, tp: int) -> HeadLayout:
    kvh, qh = arch.num_key_value_heads, arch.num_attention_heads
    group = qh // kvh
    if kvh % tp == 0:
        return HeadLayout(kvh, qh, 1, 0)
    if tp % kvh == 0 and group % (tp // kvh) == 0:
        return HeadLayout(tp, qh, tp // kvh, 0)
    padded = -(-kvh // tp) * tp
    return HeadLayout(padded, padded * group, 1, padded - kvh)


def adapted_arch(arch: ArchConfig, tp: int) -> ArchConfig:
    """The head counts the model runs with under `tp` (see head_layout)."""
    lay = head_layout(arch, tp)
    return dataclasses.replace(arch, num_key_value_heads=lay.num_kv_heads,
                               num_attention_heads=lay.num_q_heads)


def adapt_heads(arch: ArchConfig, params: dict[str, Any], tp: int) -> tuple[ArchConfig, dict[str, Any]]:
    """Replicate or pad heads (host NumPy) so that `tp` divides them; same outputs."""
    lay = head_layout(arch, tp)
    if lay.num_kv_heads == arch.num_key_value_heads:
        return arch, params
    kvh, D = arch.num_key_value_heads, arch.head_dim
    group = arch.num_attention_heads // kvh
    attn = dict(params["params"]["layers"]["self_attn"])

    def q_cols(w: np.ndarray) -> np.ndarray:  # [..., kvh * group * D] (columns of q_proj / bias)
        w = w.reshape(*w.shape[:-1], kvh, group, D)
        if lay.replicas > 1:  # split each group among its KV head's copies
            w = w.reshape(*w.shape[:-3], kvh * lay.replicas, group // lay.replicas, D)
        else:
            w = np.concatenate([w, np.zeros((*w.shape[:-3], lay.padded_groups, group, D), w.dtype)], axis=-3)
        return w.reshape(*w.shape[:-3], -1)

    def kv_cols(w: np.ndarray) -> np.ndarray:  # [..., kvh * D]
        w = w.reshape(*w.shape[:-1], kvh, D)
        if lay.replicas > 1:
            w = np.repeat(w, lay.replicas, axis=-2)
        else:
            w = np.concatenate([w, np.zeros((*w.shape[:-2], lay.padded_groups, D), w.dtype)], axis=-2)
        return w.reshape(*w.shape[:-2], -1)

    attn["q_proj"] = {k: q_cols(v) for k, v in attn["q_proj"].items()}
    attn["k_proj"] = {k: kv_cols(v) for k, v in attn["k_proj"].items()}
    attn["v_proj"] = {k: kv_cols(v) for k, v in attn["v_proj"].items()}
    o = attn["o_proj"]["kernel"]  # [L, q_heads * D, H]: rows follow q's columns
    attn["o_proj"] = {**attn["o_proj"], "kernel": np.swapaxes(q_cols(np.swapaxes(o, -1, -2)), -1, -2)}
    if "sinks" in attn:  # [L, q_heads]: a padded head's sink never meets a real score
        sinks = np.repeat(attn["sinks"][..., None], D, axis=-1).reshape(*attn["sinks"].shape[:-1], -1)
        attn["sinks"] = q_cols(sinks)[..., ::D]
    layers = dict(params["params"]["layers"], self_attn=attn)
    return adapted_arch(arch, tp), {"params": dict(params["params"], layers=layers)}
