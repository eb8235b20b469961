"""The Gated DeltaNet hybrids (Qwen3.5 `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM`,
Qwen3-Next `Qwen3NextForCausalLM`): linear-attention layers, each keeping a
fixed-size recurrent state per sequence, with a full-attention layer every few (config.json's
`layer_types`, three linear to one full in the released models).

    layer (linear)   x -> in_proj_qkv -> causal conv (its state) -> q, k, v
                       -> gated delta rule (its state S) -> RMSNorm(o) * SiLU(in_proj_z x)
                       -> out_proj
    layer (full)     attention.py's Attention, its q_proj also giving each head a gate
                       (out * sigmoid(gate) before o_proj), q/k RMSNorm, partial rotary
    every layer      RMSNorm scaling by 1 + w, then SwiGLU, or (the MoE forms) moe.py's
                       routed experts plus a shared expert scaled by sigmoid(x @ gate)

The cache is a `HybridCache`: the full-attention layers' pages as the Llama decoder's
(`kv`, slot i the i-th attention layer), and per linear layer its states in slots of a pool of
their own (`conv`, `ssm`), read and written per sequence as `AttentionMetadata.state` says
(kernels_pallas/gated_delta_rule/reference.py's ragged contract).

Layers differ in kind, so they run one after another (a Python loop, not the Llama decoder's
scan): compile time grows with the layer count. Weights are float only so far.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

import kernels_pallas
from jaxserve.config import WeightFormat
from jaxserve.kv_cache_spec import KVCacheGroups
from jaxserve.models.arch_config import ArchConfig, LinearAttention
from jaxserve.models.attention import Attention, ModelOptions, attention_spec, kv_cache_layout
from jaxserve.models.attention_metadata import AttentionMetadata, StateMetadata
from jaxserve.models.layers import RMSNorm, SwiGLU
from jaxserve.models.moe import MoE
from jaxserve.models.quantization import Dense
from jaxserve.models.rope import rope_cos_sin
from kernels_pallas.gated_delta_rule import reference as gdn


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HybridCache:
    """Every layer's state: `kv` [attention layers, num_pages, page_size, *token_shape] as the
    Llama decoder's cache; `conv` [linear layers, num_state_slots, kernel - 1, conv_dim] in the
    model's dtype; `ssm` [linear layers, num_state_slots, value heads, dk, dv] float32."""

    kv: jax.Array
    conv: jax.Array
    ssm: jax.Array


def hybrid_kv_cache_groups(cfg: ArchConfig, state_block_size: int = 0) -> KVCacheGroups:
    """The groups the engine resolves for `cfg` (engine/resolve.py), for tests and tools."""
    return KVCacheGroups.for_linear_hybrid(cfg.attention_layers, cfg.linear_layers,
                                           state_block_size)


def state_metadata(groups: KVCacheGroups, md: AttentionMetadata) -> StateMetadata:
    """Each sequence's state slots, from its recurrent group's table (whose entry i is the state
    after its first (i + 1) * state_block_size tokens; one entry for the whole context when no
    states are kept): it reads the entry of its last computed token, starting from zeros if it
    has none, and writes the entry of the step's last token (engine_core's
    RecurrentStateManager hands out the tables; padding rows name slot 0, and write nothing)."""
    g = groups.recurrent_group()
    assert g is not None  # a hybrid's groups have one
    table = md.page_indices[g]  # [S, entries]
    every = groups.groups[g].state_block_size
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    computed = md.kv_lens - q_lens
    rows = jnp.arange(table.shape[0])

    def entry(token: jax.Array) -> jax.Array:  # the entry holding the state after `token`
        index = jnp.maximum(token, 0) // every if every else jnp.zeros_like(token)
        return table[rows, index]

    return StateMetadata(read_slots=entry(computed - 1), write_slots=entry(md.kv_lens - 1),
                         has_initial_state=computed > 0)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer over a ragged batch: [T, hidden] -> [T, hidden], its conv
    and delta-rule states (this layer's [num_state_slots, ...]) read and written per sequence."""

    cfg: ArchConfig
    opts: ModelOptions

    @nn.compact
    def __call__(self, x: jax.Array, cache: HybridCache, layer: int, md: AttentionMetadata
                 ) -> tuple[jax.Array, HybridCache]:
        """`layer`: this layer's index in the cache's state arrays."""
        cfg, opts = self.cfg, self.opts
        la: LinearAttention = cfg.linear_attention  # type: ignore[assignment]  # a hybrid's
        sm: StateMetadata = md.state  # type: ignore[assignment]  # set for every hybrid step
        T, Hv = x.shape[0], la.num_value_heads
        dtype = opts.dtype

        def dense(n: int, name: str) -> Dense:
            return Dense(n, use_bias=False, dtype=dtype, param_dtype=dtype, name=name)

        qkv = dense(la.conv_dim, "in_proj_qkv")(x)
        z = dense(la.value_dim, "in_proj_z")(x)
        b = dense(Hv, "in_proj_b")(x)
        a = dense(Hv, "in_proj_a")(x)
        # [kernel, conv_dim]: tap kernel - 1 on the current token (HF's conv1d.weight [C, 1, K]).
        conv_w = self.param("conv1d", nn.initializers.normal(0.1), (la.conv_kernel, la.conv_dim),
                            dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (Hv,), dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (Hv,), dtype)
        num_seqs = md.num_seqs[0]
        # Each sequence's new states are written straight into the cache's [layers, slots, ...]
        # arrays (one scatter into the donated buffer; a layer's pool is not copied).
        rows = md.cu_q_lens.shape[0] - 1
        write = jnp.where(jnp.arange(rows) < num_seqs, sm.write_slots, cache.ssm.shape[1])
        qkv, conv_new = gdn.ragged_causal_conv1d(qkv, conv_w, cache.conv[layer], sm.read_slots,
                                                 md.cu_q_lens, num_seqs, sm.has_initial_state,
                                                 store=False)
        q = qkv[:, :la.key_dim].reshape(T, la.num_key_heads, la.key_head_dim)
        k = qkv[:, la.key_dim:2 * la.key_dim].reshape(T, la.num_key_heads, la.key_head_dim)
        v = qkv[:, 2 * la.key_dim:].reshape(T, Hv, la.value_head_dim)
        f32 = jnp.float32
        beta = jax.nn.sigmoid(b.astype(f32))
        g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
        # Token by token on the CPU, and for decode-like steps (a token per sequence); in
        # chunks of 64 for prefill on GPU/TPU, whose matrix units the chunked form is for (on
        # the CPU it does ~6x the flops for no fewer state reads, and ran no faster:
        # docs/benchmarks.md, "Gated DeltaNet hybrids").
        rows = md.cu_q_lens.shape[0] - 1
        chunked = opts.platform != "cpu" and T >= max(2 * gdn.CHUNK_SIZE, 4 * rows)
        rule = gdn.ragged_gated_delta_rule_chunked if chunked else gdn.ragged_gated_delta_rule
        o, ssm_new = rule(q, k, v, g, beta, cache.ssm[layer], sm.read_slots, md.cu_q_lens,
                          num_seqs, sm.has_initial_state, store=False)
        cache = HybridCache(
            cache.kv, cache.conv.at[layer, write].set(conv_new.astype(cache.conv.dtype), mode="drop"),
            cache.ssm.at[layer, write].set(ssm_new.astype(cache.ssm.dtype), mode="drop"))
        norm_w = self.param("norm", nn.initializers.ones, (la.value_head_dim,), dtype)
        o = gdn.rms_norm_gated(o.astype(dtype), z.reshape(T, Hv, la.value_head_dim), norm_w,
                               cfg.rms_norm_eps)
        return dense(cfg.hidden_size, "out_proj")(o.reshape(T, la.value_dim)), cache


class SparseMoeBlock(nn.Module):
    """The MoE forms' feed-forward: the routed experts (moe.py's `MoE`, params under
    `experts`) plus, when the model has one, a shared expert gated per token."""

    cfg: ArchConfig
    opts: ModelOptions

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, opts = self.cfg, self.opts
        out = MoE(cfg, opts, name="experts")(x)
        if cfg.shared_expert_intermediate_size:
            shared = SwiGLU(cfg.shared_expert_intermediate_size, cfg.hidden_size, opts.dtype,
                            name="shared_expert")(x)
            gate = Dense(1, use_bias=False, dtype=opts.dtype, param_dtype=opts.dtype,
                         name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(gate) * shared
        return out


class HybridDecoderLayer(nn.Module):
    cfg: ArchConfig
    opts: ModelOptions
    layer: int  # the layer's index in the model
    slot: int  # its slot: among the attention layers, or among the linear ones

    @nn.compact
    def __call__(self, h: jax.Array, cache: HybridCache, cos: jax.Array, sin: jax.Array,
                 md: AttentionMetadata) -> tuple[jax.Array, HybridCache]:
        cfg, opts = self.cfg, self.opts
        x = RMSNorm(cfg.rms_norm_eps, opts.dtype, cfg.norm_offset, name="input_layernorm")(h)
        if self.layer in cfg.linear_layers:
            out, cache = GatedDeltaNet(cfg, opts, name="linear_attn")(x, cache, self.slot, md)
        else:
            kv_id = jnp.asarray([0, self.slot], jnp.int32)  # group 0: the attention layers'
            out, kv = Attention(cfg, opts, name="self_attn")(
                x, jnp.asarray(self.layer, jnp.int32), kv_id, cos, sin, cache.kv, md)
            cache = dataclasses.replace(cache, kv=kv)
        h = h + out
        x = RMSNorm(cfg.rms_norm_eps, opts.dtype, cfg.norm_offset,
                    name="post_attention_layernorm")(h)
        mlp = (SparseMoeBlock(cfg, opts, name="mlp") if cfg.is_moe_layer(self.layer) else
               SwiGLU(cfg.intermediate_size, cfg.hidden_size, opts.dtype, name="mlp"))
        return h + mlp(x), cache


class Qwen3NextForCausalLM(nn.Module):
    """The hybrid decoder: `__call__` returns final hidden states and the new `HybridCache`;
    `compute_logits` as LlamaForCausalLM's."""

    cfg: ArchConfig
    opts: ModelOptions = ModelOptions()

    def setup(self) -> None:
        cfg, opts = self.cfg, self.opts
        if cfg.linear_attention is None:
            raise ValueError(f"{cfg.architecture} has no linear-attention layers")
        if opts.weight_format is not WeightFormat.FLOAT:
            raise ValueError(f"{cfg.architecture}: {opts.weight_format.value} weights are not "
                             "supported for the Gated DeltaNet hybrids yet (float only)")
        if opts.mesh is not None:
            raise ValueError(f"{cfg.architecture}: tensor parallelism is not supported for the "
                             "Gated DeltaNet hybrids yet")
        _, slots = opts.kv_cache_groups.layer_group_slot(cfg.num_hidden_layers)
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=opts.dtype,
                                     param_dtype=opts.dtype)
        self.layers = [HybridDecoderLayer(cfg, opts, i, slots[i], name=f"layers_{i}")
                       for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, opts.dtype, cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense(cfg.vocab_size, use_bias=False, dtype=opts.dtype,
                                 param_dtype=opts.dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, cache: HybridCache,
                 md: AttentionMetadata) -> tuple[jax.Array, HybridCache]:
        h, cache = self.run_layers(self.embed(input_ids), positions, cache, md)
        return self.final_norm(h), cache

    # The pieces of __call__ the model runner calls, as LlamaForCausalLM's.
    def embed(self, input_ids: jax.Array) -> jax.Array:
        return self.embed_tokens(input_ids)

    def final_norm(self, h: jax.Array) -> jax.Array:
        return self.norm(h)

    def run_layers(self, h: jax.Array, positions: jax.Array, cache: HybridCache,
                   md: AttentionMetadata) -> tuple[jax.Array, HybridCache]:
        """Every layer over a step; the state slots are `md.state`, or read from the recurrent
        group's table (`state_metadata`) when the step does not give them."""
        cfg = self.cfg
        if md.state is None:
            md = dataclasses.replace(md, state=state_metadata(self.opts.kv_cache_groups, md))
        cos, sin = rope_cos_sin(cfg, positions)
        plan = kernels_pallas.attention_plan(
            md.kv_lens, md.page_indices[0], md.cu_q_lens, md.num_seqs, num_tokens=h.shape[0],
            page_size=cache.kv.shape[2], spec=attention_spec(cfg, None),
            backend=self.opts.attention_backend)
        md = dataclasses.replace(md, plan=plan)
        for layer in self.layers:
            h, cache = layer(h, cache, cos, sin, md)
        return h, cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] -> float32 logits [N, vocab]."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def kv_cache(self, num_pages: int, page_size: int, num_state_slots: int = 0
                 ) -> HybridCache:
        """The cache's shapes (ShapeDtypeStructs): `num_pages` pages for the attention layers,
        `num_state_slots` state slots (slot 0 the null one) for each linear layer."""
        cfg, opts = self.cfg, self.opts
        la: LinearAttention = cfg.linear_attention  # type: ignore[assignment]
        layout = kv_cache_layout(cfg, opts.attention_backend, opts.kv_cache_dtype, 1)
        token = layout.token_shape
        kv = jax.ShapeDtypeStruct((len(cfg.attention_layers), num_pages, page_size, *token),
                                  layout.storage_dtype)
        n = len(cfg.linear_layers)
        conv = jax.ShapeDtypeStruct((n, num_state_slots, la.conv_kernel - 1, la.conv_dim),
                                    opts.dtype)
        ssm = jax.ShapeDtypeStruct(
            (n, num_state_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim),
            jnp.float32)
        return HybridCache(kv, conv, ssm)  # type: ignore[arg-type]  # shapes of the arrays
