"""A decoder layer's attention over the stacked paged KV cache, and the options every module
of a model reads (`ModelOptions`). The Llama-family decoder (llama.py) and Gemma's (gemma.py)
share it; llama.py's docstring describes the stacked cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

import kernels_pallas
from jaxserve.config import KVCacheDtype, WeightFormat
from jaxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroups
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.checkpoint_quant import MXFP4_BLOCK
from jaxserve.models.layers import RMSNorm
from jaxserve.models.quantization import GROUP_SIZE
from jaxserve.models.quantization import dense as make_dense
from jaxserve.models.rope import apply_rope

# A token's heads (the first axis of its entries in every layout) over "model".
KV_CACHE_SPEC = PartitionSpec(None, None, None, "model")
# --kv-cache-dtype fp8*: on CPU/GPU the cache is uint8 holding fp8 bits, as in vLLM (an fp8
# array costs XLA's CPU scatter a whole-cache conversion every step). The
# kernels scale by k_scale = v_scale = 1.0, vLLM's default without calibrated scales.
FP8_KV_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the model runs, read by every module of it (the checkpoint's shape is `ArchConfig`)."""

    dtype: Any = jnp.float32
    attention_backend: str = "reference"
    attention_interpret: bool = False  # run Pallas kernels in interpret mode (tests, research)
    mesh: Mesh | None = None  # set when tensor parallel: attention runs under shard_map
    weight_format: WeightFormat = WeightFormat.FLOAT  # models/quantization.py
    weight_group_size: int | None = GROUP_SIZE  # a scaled format's inputs per scale
    weight_act_order: bool = False  # a checkpoint's projections read their inputs permuted
    # The values the cache holds (the engine's is resolved from --kv-cache-dtype): fp8 ones are
    # stored as their bits in a uint8 cache.
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.FLOAT32
    # Which block table and cache slot each layer uses (jaxserve/kv_cache_spec.py).
    kv_cache_groups: KVCacheGroups = FULL_ATTENTION
    expert_parallel: bool = False  # mixture of experts: whole experts per device (moe.py)
    # The experts' own format, if not weight_format's (ResolvedConfig.experts_weight_format).
    experts_format: WeightFormat | None = None
    platform: str = "cpu"  # the devices' platform (moe.py picks its grouped matmul by it)

    # Layers per iteration of the scan over layers; None: the platform's choice (below). The
    # preflight's --roofline sets all of them to cost an unrolled copy (worker/program_cost.py).
    layer_unroll: int | None = None

    def scan_unroll(self, num_layers: int) -> int:
        """Unroll the scan over layers on GPU. In XLA's CUDA loop each layer's slice of a weight
        stack was copied before its GEMMs (three passes over the weights), and the loop's
        iterations were driven from the host (the GPU idled between layers); unrolled, an H200's
        decode step took less than half the time, for about 4x the compile time
        (docs/benchmarks.md, "The H200 decode step"). TPU and CPU keep the loop: it reads the
        stacks in place there."""
        if self.layer_unroll is not None:
            return min(self.layer_unroll, num_layers)
        return num_layers if self.platform == "gpu" else 1

    @property
    def experts_weights(self) -> tuple[WeightFormat, int | None]:
        """The experts' (format, inputs per scale): their own, or the other weights'."""
        if self.experts_format is not None and self.experts_format.mxfp4:
            return self.experts_format, MXFP4_BLOCK
        return self.weight_format, self.weight_group_size

    @property
    def cpu_kernel(self) -> bool:
        """Whether the platform's matmul kernels (CPU and TPU) may run: one device per stage
        (they have no sharding rule)."""
        return self.mesh is None


def kv_cache_layout(cfg: ArchConfig, attention_backend: str, kv_cache_dtype: KVCacheDtype,
                    tp: int = 1) -> kernels_pallas.KVCacheLayout:
    """One device's cache layout: its `num_kv_heads / tp` heads, in the values' type, as the
    attention backend's kernels take it."""
    return kernels_pallas.kv_cache_layout(cfg.num_key_value_heads // tp, cfg.head_dim,
                                          kv_cache_dtype.value, backend=attention_backend)


def attention_spec(cfg: ArchConfig, local: bool | None = None) -> kernels_pallas.AttentionSpec:
    """What the model's attention computes: its scale, the sliding window (Mistral's on every
    layer; with per-layer kinds, a `local` layer's), Gemma 2's logit soft cap. The cache's
    layout and scales are added where the cache is known (`paged_attention`)."""
    types = cfg.layer_types
    if local is None:
        local = types is None or all(t == "sliding_attention" for t in types)
    return kernels_pallas.AttentionSpec(
        sm_scale=(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
        sliding_window=cfg.sliding_window if cfg.sliding_window and local else None,
        soft_cap=float(cfg.attn_logit_softcap) if cfg.attn_logit_softcap else None,
    )


def paged_attention(
    q: jax.Array,  # [T, q_heads, D]
    k: jax.Array,  # [T, kv_heads, D]
    v: jax.Array,
    kv_cache: jax.Array,  # [slots, num_pages, page_size, *layout.token_shape] (this device's heads)
    slot: jax.Array,
    md: AttentionMetadata,  # of the layer's KV cache group
    sinks: jax.Array | None = None,  # [q_heads]: GPT-OSS's attention sinks
    *,
    spec: kernels_pallas.AttentionSpec,
    backend: str,
    interpret: bool,
    kv_cache_dtype: str,
    write: bool = True,
    read: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Write this layer's K/V into its slot of the stacked cache, then attend over it
    (`write=False`: only attend, the caller wrote them; `read=False`: only write, and `q`
    comes back).

    The cache is viewed as `[slots * num_pages, ...]` (a free reshape) with page ids
    and slots offset by `slot * num_pages`, so the kernels see an ordinary
    paged cache and no layer is copied out of the stack. `kv_cache_dtype` names the
    values the cache holds ("float32", "bfloat16", "fp8", ...); `spec` (`attention_spec`)
    gets this device's cache layout and scales here.
    """
    num_slots, num_pages, page_size = kv_cache.shape[:3]
    flat = kv_cache.reshape(num_slots * num_pages, *kv_cache.shape[2:])
    layout = kernels_pallas.kv_cache_layout(k.shape[1], k.shape[2], kv_cache_dtype, backend=backend)
    scale = FP8_KV_SCALE if layout.is_fp8 else None
    spec = dataclasses.replace(spec, layout=layout, k_scale=scale, v_scale=scale)
    page_offset = slot * num_pages
    if write:
        with jax.named_scope("kv_cache_update"):
            flat = kernels_pallas.update_kv_cache(
                flat, k, v, md.slot_mapping + page_offset * page_size, backend=backend,
                interpret=interpret, k_scale=scale, v_scale=scale, layout=layout,
            )
    if not read:
        return q, flat.reshape(kv_cache.shape)
    with jax.named_scope("attention"):
        out = kernels_pallas.ragged_paged_attention(
            q, flat, md.kv_lens, md.page_indices + page_offset, md.cu_q_lens, md.num_seqs,
            spec=spec, sinks=sinks, backend=backend, interpret=interpret, plan=md.plan,
        )
    return out, flat.reshape(kv_cache.shape)


def group_view(groups: KVCacheGroups, kv_id: jax.Array,
               md: AttentionMetadata) -> tuple[jax.Array, AttentionMetadata]:
    """A layer's cache slot (`kv_id`: its group and slot, KVCacheGroups.layer_group_slot),
    and the step's metadata with its group's block table and slots (the step carries one
    per group: `[G, ...]`)."""
    g = kv_id[0] if groups.hybrid else 0
    return kv_id[1], dataclasses.replace(md, slot_mapping=md.slot_mapping[g],
                                         page_indices=md.page_indices[g])


class Attention(nn.Module):
    cfg: ArchConfig
    opts: ModelOptions

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, hidden]
        layer_idx: jax.Array,  # int32[]
        kv_id: jax.Array,  # int32[2]: the layer's KV cache group and slot
        cos: jax.Array,
        sin: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        cfg, opts = self.cfg, self.opts
        T = x.shape[0]
        def dense(n: int, bias: bool, name: str) -> nn.Module:
            return make_dense(n, bias, opts.dtype, opts.weight_format, name, cfg.num_hidden_layers,
                              cpu_kernel=opts.cpu_kernel, group_size=opts.weight_group_size,
                              act_order=opts.weight_act_order)
        slot, md = group_view(opts.kv_cache_groups, kv_id, md)
        sinks = (self.param("sinks", nn.initializers.zeros, (cfg.num_attention_heads,), opts.dtype)
                 if cfg.attention_sinks else None)
        gated = cfg.attn_output_gate  # q_proj gives each head its query and its output's gate
        q = dense(cfg.q_size * (2 if gated else 1), cfg.attention_bias, "q_proj")(x, layer_idx)
        k = dense(cfg.kv_size, cfg.attention_bias, "k_proj")(x, layer_idx)
        v = dense(cfg.kv_size, cfg.attention_bias, "v_proj")(x, layer_idx)
        q = q.reshape(T, cfg.num_attention_heads, -1)
        gate = q[..., cfg.head_dim:].reshape(T, cfg.q_size) if gated else None
        q = q[..., :cfg.head_dim]
        k = k.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            offset = 1.0 if cfg.gemma else cfg.norm_offset
            q = RMSNorm(cfg.rms_norm_eps, opts.dtype, offset, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, opts.dtype, offset, name="k_norm")(k)

        def attention(local: bool | None, write: bool = True, read: bool = True) -> Any:
            run = functools.partial(
                paged_attention, spec=attention_spec(cfg, local),
                backend=opts.attention_backend, interpret=opts.attention_interpret,
                kv_cache_dtype=opts.kv_cache_dtype.value, write=write,
                read=read,
            )
            if opts.mesh is not None:
                # Each device attends with its own heads over its own slice of the cache:
                # no communication inside attention (o_proj's all-reduce follows).
                heads, cache = PartitionSpec(None, "model", None), KV_CACHE_SPEC
                run = jax.shard_map(
                    run, mesh=opts.mesh,
                    in_specs=(heads, heads, heads, cache, PartitionSpec(), PartitionSpec(),
                              PartitionSpec("model")),
                    out_specs=(heads, cache), check_vma=False,
                )
            return lambda q, k, v, cache, slot, md: run(q, k, v, cache, slot, md, sinks)

        # cos / sin [2, T, .] when sliding layers have a rope of their own (Gemma 3).
        def rope(x: jax.Array, local: bool) -> jax.Array:
            return apply_rope(x, cos[int(local)], sin[int(local)]) if cos.ndim == 3 else \
                apply_rope(x, cos, sin)

        kinds = cfg.local_layers
        if kinds is None:
            # Layers of one kind: sliding ones (a Gemma 3 with no full layer, or a pipeline
            # stage of only sliding layers) take the sliding layers' rope.
            layer_types = cfg.layer_types or ()
            local = bool(layer_types) and all(t == "sliding_attention" for t in layer_types)
            out, kv_cache = attention(None)(rope(q, local), rope(k, local), v, kv_cache,
                                            slot, md)
        else:
            # Layers of both kinds in one scan. The cache is written outside the branch (a
            # branch that wrote it made XLA's GPU pipeline copy the cache); each branch only
            # reads it, with its window, rope and plan.
            layer_is_local = jnp.asarray(kinds)[layer_idx]
            if cos.ndim == 3:
                q = jnp.where(layer_is_local, rope(q, True), rope(q, False))
                k = jnp.where(layer_is_local, rope(k, True), rope(k, False))
            else:
                q, k = rope(q, False), rope(k, False)
            _, kv_cache = attention(None, read=False)(q, k, v, kv_cache, slot, md)

            def read(is_local: bool) -> jax.Array:
                step_md = dataclasses.replace(md, plan=md.plan[int(is_local)])
                return attention(is_local, write=False)(q, k, v, kv_cache, slot, step_md)[0]

            out = jax.lax.cond(layer_is_local, lambda: read(True), lambda: read(False))
        out = out.reshape(T, cfg.q_size)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        out = dense(cfg.hidden_size, cfg.o_proj_bias, "o_proj")(out, layer_idx)
        return out, kv_cache
