"""The architecture of a Llama-family decoder, read from a Hugging Face config.

One frozen dataclass covers Llama 2/3/3.x, Mistral, SmolLM2, TinyLlama, Qwen2
(q/k/v bias), Qwen3 (q/k RMSNorm) and the mixtures of experts Mixtral and Qwen3-MoE
through fields, with the rope scalings of rope.py. It is hashable, so it is a static
argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")  # besides none ("default")
# A dense SwiGLU's params (the MLP of a dense layer; of a sparse layer, the experts' stacks).
DENSE_MLP_PARAMS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's rope scaling (transformers' `rope_scaling` / `rope_parameters`); the
    fields each type reads are in jaxserve/models/rope.py."""

    rope_type: str = "llama3"
    factor: float = 8.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn, longrope: the context the model was pretrained with
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn, longrope: cos/sin scale (None: derived from factor)
    attention_factor: float | None = None
    # longrope: per-frequency divisors below / above original_max_position_embeddings
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)}, or none)")
        for name in ("short_factor", "long_factor"):  # lists from JSON: hashable
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(float(x) for x in v))
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope rope_scaling needs short_factor and long_factor")

    @classmethod
    def from_hf(cls, rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling | None:
        """From a config's rope dict (None for the default type); `cfg` supplies what older
        configs keep beside it (original_max_position_embeddings)."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in ("default", None):
            return None
        if rope_type == "su":  # Phi-3's first name for longrope
            rope_type = "longrope"
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        orig = rope.get("original_max_position_embeddings",
                        cfg.get("original_max_position_embeddings"))
        if orig is None:
            orig = 8192 if rope_type == "llama3" else max_pos
        factor = rope.get("factor")
        if factor is None:
            factor = max_pos / orig if rope_type in ("yarn", "longrope") else 1.0
        known = {f for f in cls.__dataclass_fields__} - {"rope_type", "factor",
                                                         "original_max_position_embeddings"}
        extra = {k: v for k, v in rope.items() if k in known and v is not None}
        return cls(rope_type=rope_type, factor=float(factor),
                   original_max_position_embeddings=int(orig), **extra)


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's shapes (Qwen3.5, Qwen3-Next: config.json's `linear_*`); the
    layers it applies to are `ArchConfig.layer_types`' "linear_attention" ones."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.num_key_heads})")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim ({self.conv_kernel}) must be at least 2")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, conv_itemsize: int) -> int:
        """One sequence's states in one layer: the convolution's last kernel - 1 inputs (the
        model's dtype) and the delta rule's S per value head (float32)."""
        return ((self.conv_kernel - 1) * self.conv_dim * conv_itemsize
                + self.num_value_heads * self.key_head_dim * self.value_head_dim * 4)


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Mistral: a query at position p sees keys p-W+1..p (every layer alike).
    sliding_window: int | None = None
    partial_rotary_factor: float = 1.0  # rope on the first part of each head only (Phi-4-mini)
    # Mixture of experts (Mixtral, Qwen3-MoE; 0: a dense MLP): every layer routes each token
    # to num_experts_per_tok of num_experts SwiGLU experts of moe_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights (Mixtral always does)
    # Dense layers among the sparse ones (Qwen3-MoE's mlp_only_layers, decoder_sparse_step):
    # per layer, whether its feed-forward is the experts' (else a SwiGLU of intermediate_size).
    # None: every layer alike.
    moe_layers: tuple[bool, ...] | None = None
    # Qwen3-Next, Qwen3.5-MoE: beside the routed experts, a shared SwiGLU expert of this size
    # whose output is scaled by sigmoid(x @ shared_expert_gate) (0: none).
    shared_expert_intermediate_size: int = 0
    # Gemma 2 / 3 (models/gemma.py): 2 or 3, 0 for the others. Their norms scale by 1 + w,
    # the embedding by sqrt(hidden_size), the MLP is GeGLU, each layer has four norms.
    gemma: int = 0
    query_pre_attn_scalar: float | None = None  # softmax scale query_pre_attn_scalar^-0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits likewise
    # Per layer: "sliding_attention" (sees the last sliding_window keys) or "full_attention";
    # None: every layer alike (sliding_window, if any, applies to all).
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own rope (unscaled)
    # GPT-OSS: a learned logit per q head in every softmax (attention sinks), a bias on
    # o_proj as on q/k/v, biases on the router and the experts, and the experts' SwiGLU
    # clamped: gate <= limit, |up| <= limit, out = (up + 1) * gate * sigmoid(alpha * gate).
    attention_sinks: bool = False
    o_proj_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next: models/qwen3_next.py): the linear layers'
    # shapes; the full-attention layers' q_proj also yields a gate per head
    # (out * sigmoid(gate) before o_proj); every RMSNorm scales by 1 + w (`norm_offset`).
    linear_attention: LinearAttention | None = None
    attn_output_gate: bool = False
    norm_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.moe_layers is not None and len(self.moe_layers) != self.num_hidden_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.intermediate_size <= 0 and (not self.num_experts or self.moe_layers is not None):
            raise ValueError(f"{self.architecture}: intermediate_size must be positive for its "
                             "dense feed-forward layers")

    def stack_layers(self, param: str) -> list[int]:
        """The layers a feed-forward param (`gate`, `w_up`, `down_proj`, ...) is stacked over:
        every layer, but with `moe_layers` the sparse ones for the router and experts and the
        dense ones for DENSE_MLP_PARAMS."""
        if self.moe_layers is None:
            return list(range(self.num_hidden_layers))
        dense = param in DENSE_MLP_PARAMS
        return [i for i, sparse in enumerate(self.moe_layers) if sparse != dense]

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's feed-forward is the experts' (else a dense SwiGLU)."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[i])

    @property
    def mlp_stack_index(self) -> tuple[int, ...] | None:
        """With dense layers among the sparse (`moe_layers`): each layer's index in its own
        kind's weight stack (the sparse layers' stacks, or the dense layers')."""
        if self.moe_layers is None:
            return None
        index = {i: j for p in ("gate", "gate_proj") for j, i in enumerate(self.stack_layers(p))}
        return tuple(index[i] for i in range(self.num_hidden_layers))

    @property
    def local_layers(self) -> tuple[bool, ...] | None:
        """Which layers attend over the sliding window only, when layers differ (else None)."""
        if self.layer_types is None or "sliding_attention" not in self.layer_types \
                or len(set(self.layer_types)) < 2:
            return None
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache (all but the linear-attention ones)."""
        types = self.layer_types or ()
        return tuple(i for i in range(self.num_hidden_layers)
                     if not types or types[i] != "linear_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers (a recurrent state each, no KV cache)."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == "linear_attention")

    def layer_range(self, lo: int, hi: int) -> ArchConfig:
        """This architecture's layers lo..hi-1 (a pipeline stage)."""
        types = None if self.layer_types is None else self.layer_types[lo:hi]
        moe = {} if self.moe_layers is None else _mixed_moe_fields(self.moe_layers[lo:hi])
        return dataclasses.replace(self, num_hidden_layers=hi - lo, layer_types=types, **moe)

    @property
    def context_length(self) -> int:
        """The longest sequence the checkpoint takes (the default max_model_len): linear and
        dynamic scaling stretch max_position_embeddings by their factor, yarn the pretrained
        context (vLLM's rule); llama3 and longrope configs already give the long one."""
        s, n = self.rope_scaling, self.max_position_embeddings
        if s is None:
            return n
        if s.rope_type in ("linear", "dynamic"):
            return int(n * s.factor)
        if s.rope_type == "yarn":
            return max(n, int(s.original_max_position_embeddings * s.factor))
        return n

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token's keys and values take in the cache, all attention layers."""
        return 2 * len(self.attention_layers) * self.kv_size * itemsize

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchConfig:
        """Build from a parsed `config.json` (validates the architecture name)."""
        from jaxserve.classifier import is_classifier_architecture
        from jaxserve.models.architectures import ARCHITECTURES, resolve_architecture

        arch = resolve_architecture(cfg.get("architectures"))
        spec = ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
        if isinstance(rope, dict) and "full_attention" in rope:  # per layer type (Gemma 3)
            rope = rope["full_attention"]  # the sliding layers': local_rope_theta
        scaling = RopeScaling.from_hf(rope, cfg) if rope else None
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(rope, dict):
            theta = rope.get("rope_theta")
        eos = cfg.get("eos_token_id")
        window = cfg.get("sliding_window") if spec.sliding_window else None
        moe = _moe_fields(spec.experts, cfg)
        gemma = _gemma_fields(arch, spec.gemma, cfg)
        gpt_oss = _gpt_oss_fields(arch, spec.experts, cfg)
        hybrid = _linear_attention_fields(arch, spec.linear_attention, cfg)
        if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
            # Qwen's window applies to some layers only (max_window_layers): not implemented.
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # Qwen3.5-MoE has none: every layer's feed-forward is the experts'.
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            # A classifier has no lm_head: the decoder's generation head (never sampled from)
            # reads the embedding, and its score head is loaded apart (jaxserve/classifier.py).
            tie_word_embeddings=(bool(cfg.get("tie_word_embeddings", False))
                                 or is_classifier_architecture(arch)),
            attention_bias=bool(cfg.get("attention_bias", spec.attention_bias)),
            qk_norm=spec.qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            sliding_window=int(window) if window else None,
            partial_rotary_factor=float((rope or {}).get(
                "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            **{**moe, **gemma, **gpt_oss, **hybrid},  # a hybrid's MoE fields over moe's
        )


def _gemma_fields(arch: str, version: int | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3's fields of ArchConfig ({} for the others)."""
    if version is None:
        return {}
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"{arch}: hidden_activation {cfg.get('hidden_activation')!r} is not "
                         "supported (gelu_pytorch_tanh)")
    # Older configs have no layer_types: Gemma 2 alternates, Gemma 3 has a pattern.
    every = 2 if version == 2 else cfg.get("sliding_window_pattern",
                                            cfg.get("_sliding_window_pattern", 6))
    types = _layer_types(arch, cfg, every)
    local_theta = None
    if version == 3:
        rp = cfg.get("rope_parameters")
        local = rp.get("sliding_attention") if isinstance(rp, dict) else None
        local_theta = float((local or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    return dict(gemma=version, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                attn_logit_softcap=cfg.get("attn_logit_softcapping"),
                final_logit_softcap=cfg.get("final_logit_softcapping"),
                layer_types=tuple(types), local_rope_theta=local_theta)


def _layer_types(arch: str, cfg: dict[str, Any], every: int,
                 kinds: tuple[str, str] = ("sliding_attention", "full_attention")
                 ) -> tuple[str, ...]:
    """config.json's `layer_types`, each one of `kinds` (the other layers', then
    "full_attention"), checked against num_hidden_layers and sliding_window (ValueError naming
    them); without one, every `every`-th layer full, the others of the first kind."""
    types = cfg.get("layer_types")
    if types is None:
        types = ["full_attention" if (i + 1) % every == 0 else kinds[0]
                 for i in range(cfg["num_hidden_layers"])]
    if (not isinstance(types, (list, tuple)) or len(types) != cfg["num_hidden_layers"]
            or any(t not in kinds for t in types)):
        raise ValueError(f"{arch}: config.json layer_types must list {cfg['num_hidden_layers']} "
                         f"layers (num_hidden_layers), each one of {', '.join(kinds)}; got {types!r}")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, (int, float))
                                            and not isinstance(window, bool) and window > 0):
        raise ValueError(f"{arch}: config.json layer_types has sliding_attention layers but "
                         f"sliding_window is {window!r} (a positive number of tokens expected)")
    return tuple(types)


def _linear_attention_fields(arch: str, hybrid: bool, cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gated DeltaNet hybrid's fields of ArchConfig ({} for the others): `layer_types` of
    "linear_attention" and "full_attention" (without one, every `full_attention_interval`-th
    layer full, as transformers' configs), checked (ValueError naming the field)."""
    if not hybrid:
        return {}
    types = _layer_types(arch, cfg, int(cfg.get("full_attention_interval", 4)),
                         ("linear_attention", "full_attention"))
    missing = [k for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                           "linear_value_head_dim", "linear_conv_kernel_dim") if k not in cfg]
    if missing:
        raise ValueError(f"{arch}: config.json lacks {', '.join(missing)}")
    linear = LinearAttention(
        num_key_heads=int(cfg["linear_num_key_heads"]),
        num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]))
    moe: dict[str, Any] = {}
    if cfg.get("num_experts"):
        # Qwen3.5-MoE's router always renormalizes its top k (its config has no field for it).
        moe = dict(shared_expert_intermediate_size=int(
            cfg.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    return dict(layer_types=tuple(types), linear_attention=linear, attn_output_gate=True,
                norm_offset=1.0, **moe)


def _gpt_oss_fields(arch: str, experts: str | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's fields of ArchConfig ({} for the others): alternating sliding and full
    layers by default, as transformers' GptOssConfig."""
    if experts != "gpt_oss":
        return {}
    limit = cfg.get("swiglu_limit", 7.0)
    return dict(layer_types=_layer_types(arch, cfg, 2), attention_sinks=True,
                o_proj_bias=bool(cfg.get("attention_bias", True)), expert_bias=True,
                swiglu_limit=None if limit is None else float(limit),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))


def _moe_fields(experts: str | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' fields of ArchConfig ({} for a dense model)."""
    if experts in ("mixtral", "gpt_oss"):  # GPT-OSS: top-k logits, softmax over them
        return dict(num_experts=int(cfg["num_local_experts"]),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if experts != "qwen3_moe":
        return {}
    # transformers' rule: layer i is sparse unless listed, and only every step-th one.
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    E = int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)
    kinds = tuple(E > 0 and i not in dense and (i + 1) % step == 0
                  for i in range(cfg["num_hidden_layers"]))
    return {"num_experts": E, "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            **_mixed_moe_fields(kinds)}


def _mixed_moe_fields(kinds: tuple[bool, ...]) -> dict[str, Any]:
    """`moe_layers` for these layer kinds: None when every layer is sparse; a dense model
    (num_experts 0) when none is."""
    if all(kinds):
        return dict(moe_layers=None)
    if not any(kinds):
        return dict(num_experts=0, moe_layers=None)
    return dict(moe_layers=tuple(kinds))
