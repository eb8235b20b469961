"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): top-k routing, then each expert's
SwiGLU as one grouped matmul over the tokens sorted by expert (`jax.lax.ragged_dot`).

    router   logits = x @ gate [T, E] -> softmax -> top-k (renormalized if norm_topk_prob)
    dispatch the T*k (token, expert) pairs sorted by expert; group_sizes[e] = pairs of e
    experts  down(silu(x W_gate[e]) * x W_up[e]) for every pair, as two ragged matmuls
    combine  each pair's output times its routing weight, added back to its token

Under a mesh the layer runs under `shard_map` on the "model" axis with every token on every
device (attention leaves them replicated): without expert parallelism each device holds every
expert's slice of the intermediate size (as the dense MLP's tensor parallelism); with it
(`--enable-expert-parallel`) each device holds E / tp whole experts and computes only the
pairs routed to them. Either way the partial outputs are summed over the axis.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxserve.models.arch_config import ArchConfig


def route(logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, experts [T, k] int32) from router logits [T, E]: softmax over
    all experts, the top k, renormalized to sum 1 if `norm_topk_prob` (Mixtral's softmax over
    the top-k logits is the same thing)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, first_expert: jax.Array | int = 0
                ) -> jax.Array:
    """[T, H]: the routed experts' SwiGLU outputs summed per token, for the experts this
    device holds (`w_*` [E_local, ...], experts first_expert..+E_local); pairs routed
    elsewhere contribute nothing."""
    T, k = experts.shape
    E = w_gate.shape[0]
    local = experts.reshape(-1) - first_expert  # [T*k]
    mine = (local >= 0) & (local < E)
    # Pairs of this device's experts first, by expert; the others last (out of every group).
    order = jnp.argsort(jnp.where(mine, local, E), stable=True)
    token = order // k
    group_sizes = jnp.bincount(jnp.where(mine, local, E), length=E + 1)[:E].astype(jnp.int32)
    xs = x[token]
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    out = jax.lax.ragged_dot((nn.silu(gate) * up).astype(x.dtype), w_down, group_sizes)
    w = weights.reshape(-1)[order][:, None]
    # NOTE: where, not a product: rows outside every group are not defined by ragged_dot.
    contrib = jnp.where(mine[order][:, None], out.astype(jnp.float32) * w, 0.0)
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(contrib).astype(x.dtype)


class MoE(nn.Module):
    """The sparse feed-forward of one layer (inside the layer scan: params get [L, ...])."""

    cfg: ArchConfig
    opts: Any  # ModelOptions

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        cfg, opts = self.cfg, self.opts
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nn.initializers.normal(0.02)
        router = self.param("gate", init, (H, E), opts.dtype)
        w_gate = self.param("w_gate", init, (E, H, I), opts.dtype)
        w_up = self.param("w_up", init, (E, H, I), opts.dtype)
        w_down = self.param("w_down", init, (E, I, H), opts.dtype)
        weights, experts = route(x @ router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if opts.mesh is None:
            return experts_ffn(x, weights, experts, w_gate, w_up, w_down)
        ep, tp = opts.expert_parallel, opts.mesh.shape["model"]
        if (E if ep else I) % tp:
            raise ValueError(f"{'num_experts' if ep else 'moe_intermediate_size'} "
                             f"({E if ep else I}) must be a multiple of the tensor-parallel "
                             f"size ({tp}){' with expert parallelism' if ep else ''}")
        up_spec = PartitionSpec("model", None, None) if ep else PartitionSpec(None, None, "model")
        down_spec = PartitionSpec("model", None, None) if ep else PartitionSpec(None, "model", None)

        def local(x, weights, experts, w_gate, w_up, w_down):
            first = jax.lax.axis_index("model") * w_gate.shape[0] if ep else 0
            out = experts_ffn(x, weights, experts, w_gate, w_up, w_down, first)
            return jax.lax.psum(out, "model")

        rep = PartitionSpec()
        return jax.shard_map(local, mesh=opts.mesh,
                             in_specs=(rep, rep, rep, up_spec, up_spec, down_spec),
                             out_specs=rep, check_vma=False)(x, weights, experts, w_gate, w_up,
                                                             w_down)
