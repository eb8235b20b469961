"""The architecture of a Llama-family decoder, read from a Hugging Face config.

One frozen dataclass covers Llama 2/3/3.x, Mistral, SmolLM2, TinyLlama, Qwen2
(q/k/v bias) and Qwen3 (q/k RMSNorm) through flags. It is hashable, so it is a
static argument of `jax.jit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling (`rope_type == "llama3"`); other types are rejected."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token's keys and values take in the cache, all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * itemsize

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ArchConfig":
        """Build from a parsed `config.json` (validates the architecture name)."""
        from jaxserve.models.registry import resolve_architecture

        arch = resolve_architecture(cfg.get("architectures"))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
        scaling = None
        if rope:
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type == "llama3":
                scaling = RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(
                        rope.get("original_max_position_embeddings", 8192)
                    ),
                )
            elif rope_type != "default":
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not supported (supported: 'llama3', none)"
                )
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(cfg.get("rope_parameters"), dict):
            theta = cfg["rope_parameters"].get("rope_theta")
        eos = cfg.get("eos_token_id")
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
        if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
            # Qwen's window applies to some layers only (max_window_layers): not implemented.
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            sliding_window=int(window) if window else None,
        )
