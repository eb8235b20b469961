"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, GPT-OSS): top-k routing, then each
expert's SwiGLU as one grouped matmul over the tokens sorted by expert (`jax.lax.ragged_dot`).

    router   logits = x @ gate [T, E] -> softmax -> top-k (renormalized if norm_topk_prob)
    dispatch the T*k (token, expert) pairs sorted by expert; group_sizes[e] = pairs of e
    experts  down(silu(x W_gate[e]) * x W_up[e]) for every pair, as three grouped matmuls
    combine  each pair's output times its routing weight, added back to its token

GPT-OSS adds biases (the router's, each expert's gate / up / down) and clamps its SwiGLU
(`swiglu`); its experts' down bias is added outside the grouped matmuls, as the routing
weights' sum of the chosen experts' biases (the same under every split of the experts).

Dense layers among the sparse ones (Qwen3-MoE's mlp_only_layers, decoder_sparse_step;
ArchConfig.moe_layers): `MixedMLP` holds each kind's weights stacked over its own layers,
whole (the scan cannot slice stacks of other lengths), and each layer runs its kind's branch
(`jax.lax.cond` on the layer index) over its own entry of that stack.

Under a mesh the layer runs under `shard_map` on the "model" axis with every token on every
device (attention leaves them replicated): without expert parallelism each device holds every
expert's slice of the intermediate size (as the dense MLP's tensor parallelism); with it
(`--enable-expert-parallel`) each device holds E / tp whole experts and computes only the
pairs routed to them. Either way the partial outputs are summed over the axis.
"""

from __future__ import annotations

from typing import Any, overload

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.attention import ModelOptions
from jaxserve.models.quantization import GROUP_SIZE, dequantize_int8, int8_matmul_rows, num_groups
from jaxserve.models.variables import INT8_LAYERS, MLP_STACKS

# An expert stack: float [E, in, out], or int8 (qweight [E, out, in], scale [E, out, groups]).
Experts = jax.Array | tuple[jax.Array, jax.Array]


def _num_experts(w: Experts) -> int:
    return (w[0] if isinstance(w, tuple) else w).shape[0]


def dequantize(q: jax.Array, s: jax.Array, dtype: Any) -> jax.Array:
    """Scaled experts [..., out, in] in `dtype`: values times their group's scale. MXFP4's
    scales are uint8, each the exponent of a power of two biased by 127 (E8M0); its values
    float4, or packed (uint8: two FP4 codes a byte, the low nibble first), decoded with integer
    ops (models/checkpoint_quant.py has the format)."""
    if s.dtype == jnp.uint8:
        s = jax.lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)  # 2^(s-127)
    if q.dtype != jnp.uint8:
        return dequantize_int8(q, s.astype(dtype))
    codes = jnp.stack([q & 15, q >> 4], -1).reshape(*q.shape[:-1], -1).astype(jnp.int32)
    e, m = (codes >> 1) & 3, (codes & 1).astype(jnp.float32)
    # E2M1: e = 0 is subnormal (m / 2), else (1 + m / 2) * 2^(e - 1).
    mag = jnp.where(e == 0, m * 0.5, (2 + m) * jnp.left_shift(1, e).astype(jnp.float32) * 0.25)
    values = jnp.where(codes >= 8, -mag, mag)
    w = values.reshape(*s.shape, -1) * s[..., None]
    return w.reshape(*q.shape[:-1], -1).astype(dtype)


def _one_expert(w: Experts, e: jax.Array, dtype: Any) -> jax.Array:
    """Expert e's float [in, out] matrix (scaled: dequantized, only this one)."""
    if not isinstance(w, tuple):
        return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
    q, s = (jax.lax.dynamic_index_in_dim(a, e, keepdims=False) for a in w)
    return dequantize(q, s, dtype).T


# ragged_dot over a stack in [E, out, in] order: rows [M, in] contract with each expert's in.
_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def swiglu(gate: jax.Array, up: jax.Array, cfg: ArchConfig) -> jax.Array:
    """The experts' activation: SiLU(gate) * up, or GPT-OSS's clamped variant."""
    if cfg.swiglu_limit is None:
        return nn.silu(gate) * up
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)


def route(logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, experts [T, k] int32) from router logits [T, E]: softmax over
    all experts, the top k, renormalized to sum 1 if `norm_topk_prob` (Mixtral's softmax over
    the top-k logits is the same thing)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block of `blocked_grouped_matmul`: about the rows a group gets on average
    (fewer blocks than that would pad more rows; more, read weights more often), a power of
    two in [1, 128]."""
    per_group = max(num_rows // max(num_groups, 1), 1)
    return min(1 << (per_group.bit_length() - 1), 128)


def blocked_grouped_matmul(xs: jax.Array, w: Experts, group_sizes: jax.Array) -> jax.Array:
    """`ragged_dot` as blocks: rows [M, K] sorted by group, w [G, K, N], group_sizes [G]
    (sum <= M) -> [M, N] (rows past the groups: zeros). Each group's rows are padded to whole
    blocks of `block_rows` rows and a loop multiplies each used block by its group's matrix,
    read in place: the work is the routed rows' (at most about twice), not every group's
    times every row (XLA's CPU ragged_dot), and no gathered copy of the weights is made."""
    M, K = xs.shape
    G = _num_experts(w)
    N = (w[0].shape[1] if isinstance(w, tuple) else w.shape[2])  # scaled: [G, N, K]
    B = block_rows(M, G)
    P = -(-(M + min(G, M) * (B - 1)) // B) * B  # every padded row, at most
    padded = (group_sizes + B - 1) // B * B
    padded_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    r = jnp.arange(M, dtype=jnp.int32)
    group = jnp.searchsorted(jnp.cumsum(group_sizes), r, side="right")  # G: past the groups
    real = group < G
    g = jnp.minimum(group, G - 1)
    dest = jnp.where(real, padded_start[g] + r - start[g], P)
    blocks = jnp.zeros((P, K), xs.dtype).at[dest].set(xs, mode="drop").reshape(P // B, B, K)
    block_group = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(padded), jnp.arange(0, P, B, dtype=jnp.int32), side="right"),
        G - 1)

    def one_block(b: jax.Array, out: jax.Array) -> jax.Array:
        x_b = jax.lax.dynamic_index_in_dim(blocks, b, keepdims=False)
        w_b = _one_expert(w, block_group[b], xs.dtype)
        return jax.lax.dynamic_update_index_in_dim(out, (x_b @ w_b)[None], b, 0)

    used = (jnp.sum(padded) + B - 1) // B
    out = jax.lax.fori_loop(0, used, one_block, jnp.zeros((P // B, B, N), xs.dtype))
    out = out.reshape(P, N)[jnp.minimum(dest, P - 1)]
    return jnp.where(real[:, None], out, 0)


def grouped_matmul(xs: jax.Array, w: Experts, group_sizes: jax.Array, platform: str
                   ) -> jax.Array:
    """Rows sorted by group times their group's matrix: XLA's ragged_dot on accelerators
    (int8 experts dequantized first, the layer's stack), blocks on the CPU (whose ragged_dot
    multiplies every row by every group; int8 dequantized one block's expert at a time)."""
    if platform == "cpu":
        return blocked_grouped_matmul(xs, w, group_sizes)
    if isinstance(w, tuple):
        # The layer's stack widened in its own [E, out, in] order (no transposed copy). NOTE:
        # no optimization barrier: on the unrolled GPU forward one made XLA copy every layer's
        # slice (all alive at once); a float4 stack was copied whole on GPUs either way, so
        # they keep MXFP4 packed (docs/benchmarks.md, "GPT-OSS").
        return jax.lax.ragged_dot_general(xs, dequantize(*w, xs.dtype), group_sizes, _OUT_IN)
    return jax.lax.ragged_dot(xs, w, group_sizes)


def experts_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: Experts,
                w_up: Experts, w_down: Experts, first_expert: jax.Array | int = 0,
                platform: str = "cpu", cfg: ArchConfig | None = None,
                biases: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """[T, H]: the routed experts' SwiGLU outputs summed per token, for the experts this
    device holds (`w_*` [E_local, ...], experts first_expert..+E_local); pairs routed
    elsewhere contribute nothing. `cfg` picks the activation (`swiglu`); `biases`: the
    gate and up projections' [E_local, I]."""
    T, k = experts.shape
    E = _num_experts(w_gate)
    local = experts.reshape(-1) - first_expert  # [T*k]
    mine = (local >= 0) & (local < E)
    # Pairs of this device's experts first, by expert; the others last (out of every group).
    order = jnp.argsort(jnp.where(mine, local, E), stable=True)
    token = order // k
    group_sizes = jnp.bincount(jnp.where(mine, local, E), length=E + 1)[:E].astype(jnp.int32)
    xs = x[token]
    gate = grouped_matmul(xs, w_gate, group_sizes, platform)
    up = grouped_matmul(xs, w_up, group_sizes, platform)
    if biases is not None:  # each pair's expert's (pairs of other devices' read junk, dropped)
        e = jnp.clip(local[order], 0, E - 1)
        gate, up = gate + biases[0][e], up + biases[1][e]
    act = nn.silu(gate) * up if cfg is None else swiglu(gate, up, cfg)
    out = grouped_matmul(act.astype(x.dtype), w_down, group_sizes, platform)
    w = weights.reshape(-1)[order][:, None]
    # NOTE: where, not a product: rows outside every group are not defined by ragged_dot.
    contrib = jnp.where(mine[order][:, None], out.astype(jnp.float32) * w, 0.0)
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(contrib).astype(x.dtype)


def check_experts_split(cfg: ArchConfig, tp: int, ep: bool) -> None:
    """ValueError naming the flags when the experts cannot be split over `tp` devices: whole
    experts per device (expert parallelism) or a slice of every expert's intermediate size."""
    n, name = (cfg.num_experts, "num_experts") if ep else (cfg.moe_intermediate_size,
                                                           "moe_intermediate_size")
    if cfg.num_experts and tp > 1 and n % tp:
        raise ValueError(f"--tensor-parallel-size {tp}{' with --enable-expert-parallel' if ep else ''}: "
                         f"the model's {name} ({n}) must be a multiple of it")


def mixture(cfg: ArchConfig, opts: Any, x: jax.Array, router: jax.Array, w_gate: Experts,
            w_up: Experts, w_down: Experts, bias: dict[str, jax.Array] | None = None
            ) -> jax.Array:
    """One layer's mixture of experts on x [T, H] (router [H, E], this layer's expert stacks;
    `bias`: GPT-OSS's "gate" [E], "b_gate" / "b_up" [E, I], "b_down" [E, H]), under the
    mesh's "model" axis when there is one (the module docstring has how)."""
    logits = x @ router if bias is None else x @ router + bias["gate"]
    weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    biases = None if bias is None else (bias["b_gate"], bias["b_up"])
    out = _experts_on_mesh(cfg, opts, x, weights, experts, w_gate, w_up, w_down, biases)
    if bias is not None:  # sum_k w_k (down_k + b_down[e_k]): the biases' part, replicated
        out = out + jnp.einsum("tk,tkh->th", weights, bias["b_down"][experts].astype(
            jnp.float32)).astype(out.dtype)
    return out


def _experts_on_mesh(cfg: ArchConfig, opts: Any, x: jax.Array, weights: jax.Array,
                     experts: jax.Array, w_gate: Experts, w_up: Experts, w_down: Experts,
                     biases: tuple[jax.Array, jax.Array] | None) -> jax.Array:
    if opts.mesh is None:
        return experts_ffn(x, weights, experts, w_gate, w_up, w_down, 0, opts.platform, cfg,
                           biases)
    I = cfg.moe_intermediate_size
    ep, tp = opts.expert_parallel, opts.mesh.shape["model"]
    check_experts_split(cfg, tp, ep)
    # Where I, the intermediate size, sits: float [E, H, I] / [E, I, H]; int8 [E, I, H] /
    # [E, H, I] (and their scales alike).
    fmt, group_size = opts.experts_weights
    int8 = fmt.scaled
    spec = (lambda i_axis: PartitionSpec("model", None, None)) if ep else (
        lambda i_axis: PartitionSpec(*("model" if a == i_axis else None for a in range(3))))
    up, down = spec(1 if int8 else 2), spec(2 if int8 else 1)
    # An int8 stack is a (qweight, scale) pair: a spec for each.
    up_spec: PartitionSpec | tuple[PartitionSpec, PartitionSpec] = up
    down_spec: PartitionSpec | tuple[PartitionSpec, PartitionSpec] = down
    if int8:  # down's scales: one per input group, whole when tp does not divide them
        whole = not ep and num_groups(I, group_size) % tp
        up_spec = (up, up)
        down_spec = (down, PartitionSpec(None, None, None) if whole else down)

    def local(x, weights, experts, w_gate, w_up, w_down, biases):
        first = jax.lax.axis_index("model") * _num_experts(w_gate) if ep else 0
        out = experts_ffn(x, weights, experts, w_gate, w_up, w_down, first, opts.platform,
                          cfg, biases or None)
        return jax.lax.psum(out, "model")

    rep = PartitionSpec()
    # The gate / up biases [E, I] split as their weights' outputs: by expert or by I.
    bias_spec = PartitionSpec("model", None) if ep else PartitionSpec(None, "model")
    return jax.shard_map(local, mesh=opts.mesh,
                         in_specs=(rep, rep, rep, up_spec, up_spec, down_spec,
                                   () if biases is None else (bias_spec, bias_spec)),
                         out_specs=rep, check_vma=False)(x, weights, experts, w_gate, w_up,
                                                         w_down, biases or ())


class MoE(nn.Module):
    """The sparse feed-forward of one layer (inside the layer scan: params get [L, ...])."""

    cfg: ArchConfig
    opts: ModelOptions

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        cfg, opts = self.cfg, self.opts
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nn.initializers.normal(0.02)
        router = self.param("gate", init, (H, E), opts.dtype)
        fmt, group_size = opts.experts_weights
        w_gate: Experts
        w_up: Experts
        w_down: Experts
        if fmt.scaled:  # the whole stack, this layer's taken
            if layer is None:
                raise ValueError("scaled experts are one stack over the layers: MoE needs `layer`")
            L = cfg.num_hidden_layers
            w_gate, w_up, w_down = (_take(Int8Stack((L, E), n_out, n_in, INT8_LAYERS,
                                                    fmt.values_dtype, group_size,
                                                    fmt.values_per_byte, fmt.scale_dtype,
                                                    name=name)(), layer)
                                    for name, n_out, n_in in (("w_gate", I, H), ("w_up", I, H),
                                                              ("w_down", H, I)))
        else:
            w_gate = self.param("w_gate", init, (E, H, I), opts.dtype)
            w_up = self.param("w_up", init, (E, H, I), opts.dtype)
            w_down = self.param("w_down", init, (E, I, H), opts.dtype)
        bias = None
        if cfg.expert_bias:
            zeros = nn.initializers.zeros
            bias = {name: self.param(name, zeros, shape, opts.dtype) for name, shape in (
                ("gate_bias", (E,)), ("b_gate", (E, I)), ("b_up", (E, I)), ("b_down", (E, H)))}
            bias["gate"] = bias.pop("gate_bias")
        return mixture(cfg, opts, x, router, w_gate, w_up, w_down, bias)


class Int8Stack(nn.Module):
    """Scaled matrices held whole in a broadcast collection (models/quantization.py's layout):
    qweight [*lead, out, in] (int8, or a checkpoint's `values_dtype`), scale [*lead, out,
    groups]. The layer scan's experts ([num_layers, E]) in INT8_LAYERS; a MixedMLP's stacks
    in MLP_STACKS."""

    lead: tuple[int, ...]
    out_features: int
    in_features: int
    collection: str = INT8_LAYERS
    values_dtype: str = "int8"
    group_size: int | None = GROUP_SIZE
    values_per_byte: int = 1  # packed MXFP4: two values an element (WeightFormat)
    scale_dtype: str = "float32"

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        shape = (*self.lead, self.out_features, self.in_features // self.values_per_byte)
        q = self.variable(self.collection, "qweight", jnp.zeros, shape, jnp.dtype(self.values_dtype)).value
        s = self.variable(self.collection, "scale", jnp.ones,
                          (*shape[:-1], num_groups(self.in_features, self.group_size)),
                          jnp.dtype(self.scale_dtype)).value
        return q, s


class FloatStack(nn.Module):
    """A float [*lead, in, out] stack held whole in MLP_STACKS, as param `kernel`."""

    shape: tuple[int, ...]
    dtype: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.variable(MLP_STACKS, "kernel", jnp.zeros, self.shape, self.dtype).value


@overload
def _take(w: jax.Array, i: jax.Array) -> jax.Array: ...
@overload
def _take(w: tuple[jax.Array, jax.Array], i: jax.Array) -> tuple[jax.Array, jax.Array]: ...
def _take(w: Experts, i: jax.Array) -> Experts:
    """Entry i of a stack (of float arrays or int8 (qweight, scale) pairs)."""
    if isinstance(w, tuple):
        q, scale = w
        return (jax.lax.dynamic_index_in_dim(q, i, keepdims=False),
                jax.lax.dynamic_index_in_dim(scale, i, keepdims=False))
    return jax.lax.dynamic_index_in_dim(w, i, keepdims=False)


class MixedMLP(nn.Module):
    """The feed-forward of a model with dense layers among the sparse (ArchConfig.moe_layers):
    the sparse layers' router and experts stacked over the sparse layers, the dense layers'
    SwiGLU over the dense ones, all in MLP_STACKS (the paths a uniform model's scan has:
    `gate`, `w_gate`/`w_up`/`w_down`, `gate_proj`/`up_proj`/`down_proj`)."""

    cfg: ArchConfig
    opts: ModelOptions

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        cfg, opts = self.cfg, self.opts
        E, H, I, I_dense = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                            cfg.intermediate_size)
        if cfg.moe_layers is None:
            raise ValueError("MixedMLP is for dense layers among the sparse (ArchConfig.moe_layers)")
        n_sparse = sum(cfg.moe_layers)
        n_dense = cfg.num_hidden_layers - n_sparse
        int8 = opts.weight_format.scaled

        def stack(name: str, lead: tuple[int, ...], n_in: int, n_out: int, module: bool) -> Experts:
            if int8:
                return Int8Stack(lead, n_out, n_in, MLP_STACKS, opts.weight_format.values_dtype,
                                 opts.weight_group_size, name=name)()
            if module:  # a dense projection: `name/kernel`
                return FloatStack((*lead, n_in, n_out), opts.dtype, name=name)()
            return self.variable(MLP_STACKS, name, jnp.zeros, (*lead, n_in, n_out), opts.dtype).value

        router = self.variable(MLP_STACKS, "gate", jnp.zeros, (n_sparse, H, E), opts.dtype).value
        experts = [stack(n, (n_sparse, E), a, b, False)
                   for n, a, b in (("w_gate", H, I), ("w_up", H, I), ("w_down", I, H))]
        dense = [stack(n, (n_dense,), a, b, True) for n, a, b in (
            ("gate_proj", H, I_dense), ("up_proj", H, I_dense), ("down_proj", I_dense, H))]
        i = jnp.asarray(cfg.mlp_stack_index, jnp.int32)[layer]

        def sparse_ffn() -> jax.Array:
            w_gate, w_up, w_down = (_take(w, i) for w in experts)
            return mixture(cfg, opts, x, _take(router, i), w_gate, w_up, w_down)

        def dense_ffn() -> jax.Array:
            def proj(v: jax.Array, w: Experts) -> jax.Array:
                if isinstance(w, tuple):  # the CPU int8 kernel reads entry i of the stack
                    return int8_matmul_rows(v, w[0], w[1], i, opts.cpu_kernel)
                return v @ _take(w, i)
            gate, up, down = dense
            return proj(nn.silu(proj(x, gate)) * proj(x, up), down)

        return jax.lax.cond(jnp.asarray(cfg.moe_layers)[layer], sparse_ffn, dense_ffn)
