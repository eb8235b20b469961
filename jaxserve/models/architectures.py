"""Hugging Face `architectures` names -> what each means to the one decoder (one table).

Every name here is served by the one Llama-family decoder in `llama.py`; the
differences (q/k/v bias, q/k norm, tied head, rope scaling, a mixture-of-experts
feed-forward from `moe.py`) are fields of `ArchConfig`. A structurally different
model gets its own file and entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """What an architecture name means to `ArchConfig.from_hf_config` and the decoder."""

    sliding_window: bool = False  # config.json's `sliding_window` applies (per `layer_types` in Gemma)
    qk_norm: bool = False  # RMSNorm on each head's q and k
    attention_bias: bool = False  # q/k/v biases when config.json does not say
    gemma: int | None = None  # Gemma's version: gemma.py's decoder layer, norms, soft caps
    # A mixture of experts' config and tensor names: "mixtral", "qwen3_moe" or "gpt_oss".
    experts: str | None = None
    fused_projections: bool = False  # qkv_proj and gate_up_proj fused in the checkpoint (Phi-3)
    # Gated DeltaNet layers among full attention ones (models/qwen3_next.py's decoder).
    linear_attention: bool = False


# The one table: every name the engine serves. Each is the Llama-family decoder of llama.py
# with these differences.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(),
    "MistralForCausalLM": Architecture(sliding_window=True),
    "Qwen2ForCausalLM": Architecture(attention_bias=True),
    "Qwen3ForCausalLM": Architecture(qk_norm=True),
    "Gemma2ForCausalLM": Architecture(sliding_window=True, gemma=2),
    "Gemma3ForCausalLM": Architecture(sliding_window=True, qk_norm=True, gemma=3),
    "Phi3ForCausalLM": Architecture(sliding_window=True, fused_projections=True),
    # Mixtures of experts: the same decoder with models/moe.py as its feed-forward.
    "MixtralForCausalLM": Architecture(sliding_window=True, experts="mixtral"),
    "Qwen3MoeForCausalLM": Architecture(qk_norm=True, experts="qwen3_moe"),
    # Sliding and full layers, attention sinks, biased projections and experts (moe.py).
    "GptOssForCausalLM": Architecture(sliding_window=True, attention_bias=True, experts="gpt_oss"),
    # Gated DeltaNet hybrids: models/qwen3_next.py, their experts (with a shared one) moe.py's.
    "Qwen3_5ForCausalLM": Architecture(qk_norm=True, linear_attention=True),
    "Qwen3_5MoeForCausalLM": Architecture(qk_norm=True, linear_attention=True, experts="qwen3_moe"),
    "Qwen3NextForCausalLM": Architecture(qk_norm=True, linear_attention=True, experts="qwen3_moe"),
}
# Each family's sequence classifier (transformers' *ForSequenceClassification): the same
# decoder, its `score` head in place of the lm_head (jaxserve/classifier.py).
ARCHITECTURES.update({
    name.replace("ForCausalLM", "ForSequenceClassification"): spec
    for name, spec in list(ARCHITECTURES.items()) if not spec.linear_attention})
ARCHITECTURES["Gemma3TextForSequenceClassification"] = ARCHITECTURES.pop(
    "Gemma3ForSequenceClassification")  # transformers' Gemma3ForSequenceClassification is multimodal

# Image-and-text checkpoints whose text decoder is served alone (images are not read): their
# config.json nests it under `text_config`, their weights under `model.language_model`.
TEXT_DECODER_OF: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def text_decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as its text decoder's when it names one of TEXT_DECODER_OF (the top level's
    keys, such as quantization_config, kept under text_config's), else unchanged."""
    names = config.get("architectures") or []
    text = next((TEXT_DECODER_OF[n] for n in names if n in TEXT_DECODER_OF), None)
    if text is None or not isinstance(config.get("text_config"), dict):
        return config
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**outer, **config["text_config"], "architectures": [text]}


def supported_architectures() -> list[str]:
    """The generative architectures (each but the Gated DeltaNet hybrids has its
    *ForSequenceClassification too)."""
    return sorted(n for n in ARCHITECTURES if n.endswith("ForCausalLM"))


def _supported() -> str:
    return (", ".join(supported_architectures())
            + " (and each one's *ForSequenceClassification, but the Gated DeltaNet hybrids'; "
            + ", ".join(TEXT_DECODER_OF) + " as their text decoder)")


def resolve_architecture(names: Sequence[str] | None) -> str:
    """Return the first supported name in a config's `architectures` list.

    Raises ValueError naming what was asked for and what is supported.
    """
    if not names:
        raise ValueError(
            "config.json has no 'architectures' entry; supported: "
            + _supported()
        )
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(
        f"architecture {', '.join(names)} is not supported; supported: "
        + _supported()
    )
