"""Hugging Face `architectures` names -> the decoder that implements them.

Every name here is served by the one Llama-family decoder in `llama.py`; the
differences (q/k/v bias, q/k norm, tied head, rope scaling, a mixture-of-experts
feed-forward from `moe.py`) are fields of `ArchConfig`. A structurally different
model gets its own file and entry.
"""

from __future__ import annotations

from collections.abc import Sequence

# name -> module implementing it (Gemma's decoder layer in gemma.py, inside llama.py's model).
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma",  # its decoder layer (gemma.py) in llama.py's model
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "llama",  # fused qkv / gate_up split at load (loaders/weights.py)
    # Mixtures of experts: the same decoder with models/moe.py as its feed-forward.
    "MixtralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(names: Sequence[str] | None) -> str:
    """Return the first supported name in a config's `architectures` list.

    Raises ValueError naming what was asked for and what is supported.
    """
    if not names:
        raise ValueError(
            "config.json has no 'architectures' entry; supported: "
            + ", ".join(supported_architectures())
        )
    for name in names:
        if name in _ARCHITECTURES:
            return name
    raise ValueError(
        f"architecture {', '.join(names)} is not supported; supported: "
        + ", ".join(supported_architectures())
    )
