"""The Llama-family decoder (Llama 2/3/3.x, Mistral, SmolLM2, TinyLlama, Qwen2, Qwen3, and
with moe.py's feed-forward Mixtral and Qwen3-MoE).

Layers are stacked and run under `nn.scan`: one compiled layer body instead of
`num_hidden_layers` unrolled copies keeps CPU and TPU compile time low (GPU unrolls it:
`ModelOptions.scan_unroll`). The KV cache of
all layers is one array carried through the scan and updated in place:

    kv_cache [slots, num_pages, page_size, *token_shape]
             (slots: the layers, or with KV cache groups a group's layers, kv_cache_spec.py)
             (token_shape: the kernels' layout for the platform, kernels_pallas/kv_cache.py;
              [2 * num_kv_heads, head_dim] on CPU and GPU, packed int32 rows on TPU)

Inside a layer of slot `i` the cache is viewed as `[slots * num_pages, ...]` (a free
reshape) and page ids / slots are offset by `i * num_pages`, so the attention
kernels see an ordinary paged cache and nothing copies a layer out of the stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas
from jaxserve.config import WeightFormat
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.attention import Attention, ModelOptions, attention_spec, kv_cache_layout
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.gemma import GemmaDecoderLayer
from jaxserve.models.layers import RMSNorm, SwiGLU
from jaxserve.models.moe import MixedMLP, MoE
from jaxserve.models.quantization import dense as make_dense
from jaxserve.models.quantization import embed as make_embed
from jaxserve.models.rope import needs_seq_lens, rope_cos_sin, token_seq_lens
from jaxserve.models.variables import INT8_LAYERS, MLP_STACKS


class DecoderLayer(nn.Module):
    cfg: ArchConfig
    opts: ModelOptions

    @nn.compact
    def __call__(
        self,
        carry: tuple[jax.Array, jax.Array],
        layer_idx: jax.Array,
        kv_id: jax.Array,  # int32[2]: the layer's KV cache group and slot
        cos: jax.Array,
        sin: jax.Array,
        md: AttentionMetadata,
    ) -> tuple[tuple[jax.Array, jax.Array], None]:
        h, kv_cache = carry
        cfg, opts = self.cfg, self.opts
        attn_in = RMSNorm(cfg.rms_norm_eps, opts.dtype, name="input_layernorm")(h)
        attn_out, kv_cache = Attention(cfg, opts, name="self_attn")(
            attn_in, layer_idx, kv_id, cos, sin, kv_cache, md
        )
        h = h + attn_out
        mlp_in = RMSNorm(cfg.rms_norm_eps, opts.dtype, name="post_attention_layernorm")(h)
        mlp: MixedMLP | MoE | SwiGLU
        if cfg.moe_layers is not None:  # dense layers among the sparse
            mlp = MixedMLP(cfg, opts, name="mlp")
        elif cfg.num_experts:
            mlp = MoE(cfg, opts, name="mlp")
        else:
            mlp = SwiGLU(cfg.intermediate_size, cfg.hidden_size, opts.dtype, opts.weight_format,
                         cfg.num_hidden_layers, opts.cpu_kernel,
                         group_size=opts.weight_group_size, act_order=opts.weight_act_order,
                         name="mlp")
        h = h + mlp(mlp_in, layer_idx)
        return (h, kv_cache), None


class LlamaForCausalLM(nn.Module):
    """`__call__` runs the decoder and returns final hidden states and the new cache;
    `compute_logits` applies the LM head only to the rows that are sampled."""

    cfg: ArchConfig
    opts: ModelOptions = ModelOptions()

    def setup(self) -> None:
        cfg, opts = self.cfg, self.opts
        self.embed_tokens = make_embed(cfg.vocab_size, cfg.hidden_size, opts.dtype, opts.weight_format,
                                       opts.cpu_kernel, cfg.tie_word_embeddings)
        self.layers = nn.scan(
            GemmaDecoderLayer if cfg.gemma else DecoderLayer,
            variable_axes={"params": 0},
            # Whole stacks, indexed by layer inside: int8 weights, a MixedMLP's.
            variable_broadcast=[INT8_LAYERS, MLP_STACKS],
            split_rngs={"params": True},
            in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_hidden_layers,
            unroll=opts.scan_unroll(cfg.num_hidden_layers),
        )(cfg, opts)
        self.norm = RMSNorm(cfg.rms_norm_eps, opts.dtype, 1.0 if cfg.gemma else 0.0)
        if not cfg.tie_word_embeddings:
            # A checkpoint stored quantized keeps its LM head in float (quantization.py).
            head = WeightFormat.FLOAT if opts.weight_format.from_checkpoint else opts.weight_format
            self.lm_head = make_dense(cfg.vocab_size, False, opts.dtype, head,
                                      cpu_kernel=opts.cpu_kernel)

    def __call__(
        self,
        input_ids: jax.Array,  # int32[T]
        positions: jax.Array,  # int32[T]
        kv_cache: jax.Array,  # LlamaForCausalLM.kv_cache(num_pages, page_size)
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        h, kv_cache = self.run_layers(self.embed(input_ids), positions, kv_cache, md)
        return self.final_norm(h), kv_cache

    # The pieces of __call__, for pipeline stages: the first embeds, every stage runs
    # its own layers (a config with its layer count), the last normalises.
    def embed(self, input_ids: jax.Array) -> jax.Array:
        x = self.embed_tokens(input_ids)
        if self.cfg.gemma:  # Gemma scales the embedding by sqrt(hidden), in its dtype
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        return x

    def run_layers(
        self, h: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        seq_lens = (token_seq_lens(md.kv_lens, md.cu_q_lens, h.shape[0])
                    if needs_seq_lens(self.cfg) else None)
        cfg = self.cfg
        cos, sin = rope_cos_sin(cfg, positions, seq_lens)
        if cfg.local_rope_theta is not None:  # Gemma 3's sliding layers: a rope of their own
            local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
            lc, ls = rope_cos_sin(local, positions)
            cos, sin = jnp.stack([cos, lc]), jnp.stack([sin, ls])

        def make_plan(local: bool | None) -> Any:
            return kernels_pallas.attention_plan(
                md.kv_lens, md.page_indices[0], md.cu_q_lens, md.num_seqs, num_tokens=h.shape[0],
                page_size=kv_cache.shape[2], spec=attention_spec(cfg, local),
                backend=self.opts.attention_backend)

        # Layers of both kinds: a plan for each (full, local), the layer picks its own.
        plan = make_plan(None) if cfg.local_layers is None else (make_plan(False), make_plan(True))
        md = dataclasses.replace(md, plan=plan)
        layer_ids = jnp.arange(self.cfg.num_hidden_layers, dtype=jnp.int32)
        # Scanned like the layer index, not looked up from it: unrolled (GPU), each layer's
        # group and slot are then constants (looked up, they were two scalars a layer, and
        # XLA's fusion of the slot offsets spilled registers: docs/benchmarks.md,
        # "Sliding-window groups").
        kv_ids = jnp.asarray(np.stack(
            self.opts.kv_cache_groups.layer_group_slot(self.cfg.num_hidden_layers), 1), jnp.int32)
        (h, kv_cache), _ = self.layers((h, kv_cache), layer_ids, kv_ids, cos, sin, md)
        return h, kv_cache

    def final_norm(self, h: jax.Array) -> jax.Array:
        return self.norm(h)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] -> float32 logits [N, vocab]."""
        if self.cfg.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return logits if not cap else cap * jnp.tanh(logits / cap)


    def kv_cache(self, num_pages: int, page_size: int, num_state_slots: int = 0
                 ) -> jax.ShapeDtypeStruct:
        """The whole (every device's heads) stacked cache this model runs with
        (`num_state_slots`: a Gated DeltaNet hybrid's; these layers keep no state)."""
        opts = self.opts
        tp = 1 if opts.mesh is None else opts.mesh.shape["model"]
        layout = kv_cache_layout(self.cfg, opts.attention_backend, opts.kv_cache_dtype, tp)
        token = layout.token_shape
        slots = opts.kv_cache_groups.slots(self.cfg.num_hidden_layers)
        shape = (slots, num_pages, page_size, tp * token[0], *token[1:])
        return jax.ShapeDtypeStruct(shape, layout.storage_dtype)
