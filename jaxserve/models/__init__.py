"""Models: the Llama-family decoder, its architecture table and the checkpoint loaders.

The decoder (and JAX with it) loads on first use, so reading a checkpoint's architecture
(`loaders.read_arch` of an HF folder, the architecture table) stays JAX-free and fast: the preflight
refuses an unsupported model in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.architectures import resolve_architecture, supported_architectures

if TYPE_CHECKING:
    from jaxserve.models.attention_metadata import AttentionMetadata
    from jaxserve.models.llama import LlamaForCausalLM

__all__ = [
    "ArchConfig",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "resolve_architecture",
    "supported_architectures",
]


def __getattr__(name: str) -> Any:
    if name == "AttentionMetadata":
        from jaxserve.models.attention_metadata import AttentionMetadata

        return AttentionMetadata
    if name == "LlamaForCausalLM":
        from jaxserve.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise AttributeError(name)
