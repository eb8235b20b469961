"""Load a GGUF file (llama.cpp's format): metadata -> ArchConfig, tensors dequantized.

Tensors are dequantized with the `gguf` package's vectorised NumPy code (F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, Q4_K, Q5_K, Q6_K, ...). llama.cpp's converter
permutes the rows of q/k projections of `llama` models so that its rotary
kernel can rotate adjacent pairs; we rotate halves (Hugging Face layout), so
the permutation is undone here.
"""

from __future__ import annotations

import os
import re
from typing import Any

import gguf
import numpy as np

from jaxserve.models.arch_config import ArchConfig, RopeScaling
from jaxserve.models.rope import rope_inv_freq
from jaxserve.models.loaders.weights import WeightLoadError, build_params

# GGUF `general.architecture` -> (HF architecture, q/k rows permuted by llama.cpp)
_GGUF_ARCHES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def read_gguf(path: str) -> gguf.GGUFReader:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors on bad files
        raise WeightLoadError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_arch_config(reader: gguf.GGUFReader, path: str) -> tuple[ArchConfig, bool]:
    """ArchConfig from GGUF metadata, and whether q/k rows must be unpermuted."""
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(sorted(_GGUF_ARCHES))
        )
    hf_arch, permuted = _GGUF_ARCHES[arch]
    names = {t.name for t in reader.tensors}
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = ArchConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
    )
    if "rope_freqs.weight" in names:
        cfg = _with_llama3_rope(cfg, reader, path)
    return cfg, permuted


def _with_llama3_rope(cfg: ArchConfig, reader: gguf.GGUFReader, path: str) -> ArchConfig:
    """llama.cpp stores Llama-3 rope scaling as per-frequency divisors; we keep
    the parameters, so check that the default Llama-3 parameters reproduce them."""
    import dataclasses

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    scaled = dataclasses.replace(
        cfg,
        rope_scaling=RopeScaling(
            original_max_position_embeddings=int(
                _field(reader, f"{_field(reader, 'general.architecture')}.rope.scaling.original_context_length", 8192)
            )
        ),
    )
    base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    if not np.allclose(base / rope_inv_freq(scaled), factors, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs.weight does not match Llama-3 rope scaling")
    return scaled


def load_gguf(path: str, dtype: Any, quantization: str | None = None) -> tuple[ArchConfig, dict[str, Any]]:
    """Return the architecture and the param tree of a GGUF checkpoint.

    Each tensor is dequantized on its own when read; with `quantization="int8"` it is
    quantized again at once, so the float32 model never exists whole. (Q8_0's blocks of 32
    are not taken over as they are: our int8 groups are 64 inputs, at one token 1.6x faster
    in XLA's CPU matmul than groups of 32.)
    """
    reader = read_gguf(path)
    cfg, permuted = gguf_arch_config(reader, path)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            tensors[name] = t

    def get(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            return None
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise WeightLoadError(
                f"{path}: tensor {t.name!r} ({t.tensor_type.name}) cannot be dequantized ({e})"
            ) from None
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        return w

    return cfg, build_params(cfg, get, dtype, path, quantization)
