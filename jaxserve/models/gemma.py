"""Gemma 2 and Gemma 3 (text): their decoder layer, on the Llama-family decoder's attention.

    h = h + post_attention_norm(attention(input_norm(h)))       # sandwich norms, all
    h = h + post_feedforward_norm(GeGLU(pre_feedforward_norm(h)))  # scaling by 1 + w

The rest are fields of ArchConfig that llama.py reads: the embedding times sqrt(hidden), the
softmax scale query_pre_attn_scalar^-0.5, Gemma 2's attention and final logit soft caps,
Gemma 3's q/k norms, and per-layer kinds (`layer_types`): a sliding layer sees the last
`sliding_window` keys and (Gemma 3) has its own rope base, a full layer sees everything; one
layer scan holds both, each layer's kind choosing its branch (`jax.lax.cond`).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.attention import Attention, ModelOptions
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.layers import RMSNorm, SwiGLU


class GemmaDecoderLayer(nn.Module):
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

        def norm(name: str) -> nn.Module:
            return RMSNorm(cfg.rms_norm_eps, opts.dtype, 1.0, name=name)

        attn_out, kv_cache = Attention(cfg, opts, name="self_attn")(
            norm("input_layernorm")(h), layer_idx, kv_id, cos, sin, kv_cache, md)
        h = h + norm("post_attention_layernorm")(attn_out)
        mlp = SwiGLU(cfg.intermediate_size, cfg.hidden_size, opts.dtype, opts.weight_format,
                     cfg.num_hidden_layers, opts.cpu_kernel, "gelu_pytorch_tanh",
                     opts.weight_group_size, opts.weight_act_order, name="mlp")
        h = h + norm("post_feedforward_layernorm")(mlp(norm("pre_feedforward_layernorm")(h),
                                                       layer_idx))
        return (h, kv_cache), None
