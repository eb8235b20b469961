"""Load a GGUF file (llama.cpp's format): metadata -> ArchConfig, tensors dequantized.

Tensors are dequantized with the `gguf` package's vectorised NumPy code (F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, Q4_K, Q5_K, Q6_K, ...). The metadata becomes the
Hugging Face config it was converted from, so one parser (ArchConfig.from_hf_config) reads
both; tensors are asked for by their HF names, which the `gguf` package's own name map turns
into GGUF's. What llama.cpp's converter changed is undone here: it permutes the q/k rows of
`llama` models so that its rotary kernel can rotate adjacent pairs (we rotate halves, the HF
layout), stores Gemma's norms as 1 + w (its graph multiplies by the stored weight) and
stacks each layer's experts into one [E, out, in] tensor.
"""

from __future__ import annotations

import os
import re
from typing import Any

import gguf
import numpy as np

from jaxserve.config import WeightFormat
from jaxserve.models.arch_config import ArchConfig, RopeScaling
from jaxserve.models.loaders.weights import WeightLoadError, build_params
from jaxserve.models.model_files import open_gguf
from jaxserve.models.rope import rope_inv_freq

# GGUF `general.architecture` -> the Hugging Face architecture it was converted from
# ("llama" with experts is Mixtral, as llama.cpp's converter writes it).
_GGUF_ARCHES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_PERMUTED = ("llama", "mistral")  # llama.cpp permutes these archs' q/k rows
_NORMS_PLUS_ONE = ("gemma2", "gemma3")  # llama.cpp stores Gemma's norms as 1 + w
# Gemma's 27B models scale queries by hidden/heads, not head_dim; llama.cpp knows them by
# their layer count, as GGUF has no query_pre_attn_scalar.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# One expert's matrix in the stacked [E, out, in] GGUF tensors, by its HF name.
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up",
                "w2": "down", "down_proj": "down"}


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
        return open_gguf(path)
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
    cfg = ArchConfig.from_hf_config(gguf_hf_config(reader, arch))
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        cfg = _with_llama3_rope(cfg, reader, path)
    return cfg, arch in _PERMUTED


def gguf_hf_config(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """The Hugging Face config.json that llama.cpp's converter read, as far as GGUF keeps it
    (what it drops is llama.cpp's fixed per-architecture rule, applied here the same way)."""
    names = {t.name for t in reader.tensors}
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    experts = int(get("expert_count", 0) or 0)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg: dict[str, Any] = dict(
        architectures=["MixtralForCausalLM" if arch == "llama" and experts else _GGUF_ARCHES[arch]],
        vocab_size=int(get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
        sliding_window=get("attention.sliding_window"),
    )
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:  # Phi-4-mini: rope on part of a head
        cfg["partial_rotary_factor"] = int(rope_dim) / head_dim
    orig = get("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in names:  # Phi-3's LongRoPE: per-frequency factors as tensors
        cfg["rope_scaling"] = dict(
            rope_type="longrope", original_max_position_embeddings=int(orig or cfg["max_position_embeddings"]),
            long_factor=_tensor(reader, "rope_factors_long.weight").tolist(),
            short_factor=_tensor(reader, "rope_factors_short.weight").tolist(),
            attention_factor=get("rope.scaling.attn_factor"))
    elif get("rope.scaling.type") in ("linear", "yarn"):
        cfg["rope_scaling"] = dict(rope_type=get("rope.scaling.type"),
                                   factor=float(get("rope.scaling.factor", 1.0)),
                                   original_max_position_embeddings=orig)
    if experts:
        used, width = int(get("expert_used_count")), get("expert_feed_forward_length")
        cfg.update(num_local_experts=experts, num_experts=experts, num_experts_per_tok=used,
                   moe_intermediate_size=int(width or cfg["intermediate_size"]),
                   # llama.cpp renormalizes Qwen3-MoE's top-k always, unless the key says so.
                   norm_topk_prob=bool(get("expert_weights_norm", True)))
        if arch == "llama":
            cfg["intermediate_size"] = cfg["moe_intermediate_size"]
    if arch in _NORMS_PLUS_ONE:
        big, scale = layers == _GEMMA_27B_LAYERS[arch], get("attention.scale")
        cfg.update(query_pre_attn_scalar=(hidden // heads if big else head_dim) if scale is None
                   else 1.0 / float(scale) ** 2,
                   attn_logit_softcapping=get("attn_logit_softcapping"),
                   final_logit_softcapping=get("final_logit_softcapping"),
                   rope_local_base_freq=float(get("rope.freq_base_swa", 10000.0)))
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: true = sliding
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern is not None:
            cfg["sliding_window_pattern"] = int(pattern)
    return cfg


# Values per call of a quantized type's row dequantizer: the gguf package's own loop calls it
# on 16 rows at a time, whose per-call overhead was half the default model's load.
_DEQUANT_CHUNK_VALUES = 1 << 20


def dequantize_tensor(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """A GGUF tensor's values as float32 (the gguf package's formulas, over large chunks of
    rows: the same values, about twice as fast)."""
    quant: Any = getattr(gguf.quants, qtype.name, None)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if block == 1 or not hasattr(quant, "dequantize_rows"):  # F32, F16, BF16 (or unknown)
        return np.asarray(gguf.quants.dequantize(data, qtype), np.float32)
    quant.init_grid()  # the IQ types' lookup grids
    rows = data.reshape(-1, data.shape[-1])
    row_values = rows.shape[1] // type_size * block
    out = np.empty((rows.shape[0], row_values), np.float32)
    step = max(1, _DEQUANT_CHUNK_VALUES // row_values)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = quant.dequantize_rows(rows[i:i + step])
    return out.reshape(*data.shape[:-1], row_values)


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return dequantize_tensor(t.data, t.tensor_type)


def _with_llama3_rope(cfg: ArchConfig, reader: gguf.GGUFReader, path: str) -> ArchConfig:
    """llama.cpp stores Llama-3 rope scaling as per-frequency divisors; we keep
    the parameters, so check that the default Llama-3 parameters reproduce them."""
    import dataclasses

    factors = _tensor(reader, "rope_freqs.weight")
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


def load_gguf(path: str, dtype: Any, weight_format: WeightFormat = WeightFormat.FLOAT
              ) -> tuple[ArchConfig, dict[str, Any]]:
    """Return the architecture and the param tree of a GGUF checkpoint.

    Each tensor is dequantized on its own when read; with `WeightFormat.INT8` it is
    quantized again at once, so the float32 model never exists whole. (Q8_0's blocks of 32
    are not taken over as they are: our int8 groups are 64 inputs, faster in XLA's CPU matmul
    at one token than groups of 32.)
    """
    reader = read_gguf(path)
    cfg, permuted = gguf_arch_config(reader, path)
    arch = _field(reader, "general.architecture")
    # The gguf package's own HF -> GGUF tensor names for the arch (Mistral's are Llama's).
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH["LLAMA" if arch == "mistral" else arch.upper()],
                                     cfg.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    stack: dict[str, np.ndarray] = {}  # the last expert stack read: each is read once

    def dequantize(t: gguf.ReaderTensor) -> np.ndarray:
        try:
            return dequantize_tensor(t.data, t.tensor_type)
        except Exception as e:
            raise WeightLoadError(
                f"{path}: tensor {t.name!r} ({t.tensor_type.name}) cannot be dequantized ({e})"
            ) from None

    def dequantize_named(gguf_name: str) -> np.ndarray | None:
        t = tensors.get(gguf_name)
        return None if t is None else dequantize(t)

    def get(name: str) -> np.ndarray | None:
        if m := _EXPERT.fullmatch(name):
            layer, expert, kind = m.group(1), int(m.group(2)), _EXPERT_KIND[m.group(3)]
            stacked = f"blk.{layer}.ffn_{kind}_exps.weight"
            if stacked not in tensors:  # older files: one tensor per expert
                return dequantize_named(f"blk.{layer}.ffn_{kind}.{expert}.weight")
            if stacked not in stack:
                stack.clear()
                stack[stacked] = dequantize(tensors[stacked])
            experts = stack[stacked]
            return None if expert >= len(experts) else np.ascontiguousarray(experts[expert])
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        w = None if gguf_name is None else dequantize_named(gguf_name)
        if w is None:
            return None
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        elif arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1.0
        return w

    return cfg, build_params(cfg, get, dtype, path, weight_format)
