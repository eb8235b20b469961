"""Models: the Llama-family decoder, its registry and the checkpoint loaders."""

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.registry import resolve_architecture, supported_architectures

__all__ = [
    "ArchConfig",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "resolve_architecture",
    "supported_architectures",
]
