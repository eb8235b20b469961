"""Models: the Llama-family decoder, its architecture table and the checkpoint loaders.

The decoder (and JAX with it) loads on first use, so reading a checkpoint's architecture
(`loaders.read_arch` of an HF folder, the architecture table) stays JAX-free and fast: the preflight
refuses an unsupported model in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.architectures import resolve_architecture, supported_architectures

if TYPE_CHECKING:
    from jaxserve.models.attention_metadata import AttentionMetadata
    from jaxserve.models.llama import LlamaForCausalLM
    from jaxserve.models.qwen3_next import Qwen3NextForCausalLM

    # The decoders the model runner drives (each has embed, run_layers, final_norm,
    # compute_logits and kv_cache).
    DecoderModel: TypeAlias = LlamaForCausalLM | Qwen3NextForCausalLM

__all__ = [
    "ArchConfig",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "resolve_architecture",
    "decoder_class",
    "supported_architectures",
]


def decoder_class(arch: ArchConfig) -> type[LlamaForCausalLM] | type[Qwen3NextForCausalLM]:
    """The decoder module of an architecture: the Gated DeltaNet hybrids' own, else the
    Llama-family one (architectures.py's table)."""
    if arch.linear_attention is not None:
        from jaxserve.models.qwen3_next import Qwen3NextForCausalLM

        return Qwen3NextForCausalLM
    from jaxserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def __getattr__(name: str) -> Any:
    if name == "AttentionMetadata":
        from jaxserve.models.attention_metadata import AttentionMetadata

        return AttentionMetadata
    if name == "LlamaForCausalLM":
        from jaxserve.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise AttributeError(name)
