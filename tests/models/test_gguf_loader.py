"""GGUF loading: a tiny HF Llama written as llama.cpp would (q/k rows permuted,
quantized tensors), read back and compared with transformers."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.config import WeightFormat
from jaxserve.models import LlamaForCausalLM
from jaxserve.models.loaders import WeightLoadError, load_checkpoint
from jaxserve.models.loaders.gguf_loader import load_gguf
from tests.models.forward import prompt_logits
from tests.models.test_llama_vs_hf import PROMPTS
from tests.models.tiny import TINY_COMMON, hf_logits, save_tiny_hf

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (written independently)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str, path: str, qtype: Q = Q.F32) -> None:
    from safetensors.numpy import load_file

    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    c = TINY_COMMON
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c["vocab_size"])
    for name, t in sd.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_NAMES[suffix]}"
            if suffix == "self_attn.q_proj.weight":
                t = llama_cpp_permute(t, c["num_attention_heads"])
            elif suffix == "self_attn.k_proj.weight":
                t = llama_cpp_permute(t, c["num_key_value_heads"])
        if t.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, t.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_f32_matches_transformers(tmp_path) -> None:
    model_dir = save_tiny_hf("llama", str(tmp_path))
    path = str(tmp_path / "tiny.gguf")
    write_gguf(model_dir, path)
    arch, params = load_checkpoint(path, np.float32)
    assert arch.tie_word_embeddings and arch.num_key_value_heads == 2
    model = LlamaForCausalLM(arch)
    for ids in PROMPTS[:2]:
        ours = prompt_logits(model, params, ids)
        ref = hf_logits(model_dir, ids)
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
        assert np.abs(ours - ref).max() <= 1e-3


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_quantized_types_dequantize(qtype: Q, tmp_path) -> None:
    model_dir = save_tiny_hf("llama", str(tmp_path))
    ref_path, q_path = str(tmp_path / "f32.gguf"), str(tmp_path / "q.gguf")
    write_gguf(model_dir, ref_path)
    write_gguf(model_dir, q_path, qtype)
    _, ref = load_gguf(ref_path, np.float32)
    _, got = load_gguf(q_path, np.float32)
    a = ref["params"]["layers"]["self_attn"]["q_proj"]["kernel"]
    b = got["params"]["layers"]["self_attn"]["q_proj"]["kernel"]
    # 4-bit types keep ~1/8 of the range per block; 8-bit and halves much more.
    tol = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}.get(qtype, 0.25) * np.abs(a).max()
    assert np.abs(a - b).max() <= tol


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_gguf_k_quants_load(qtype: Q, tmp_path) -> None:
    """gguf cannot quantize K-quants in Python; write valid random blocks instead and
    check that the loader places their dequantized values, shapes and all."""
    model_dir = save_tiny_hf("llama", str(tmp_path), hidden_size=256, intermediate_size=256)
    # Only the embedding is K-quantized; the rest stays F32.
    path = str(tmp_path / "k.gguf")
    c = {**TINY_COMMON, "hidden_size": 256}
    rng = np.random.default_rng(0)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = c["vocab_size"]
    raw = rng.integers(0, 256, size=(rows, 256 // block_elems * block_bytes), dtype=np.uint8)
    # Keep the f16 super-block scales small and finite (Q4_K: d, dmin first; Q6_K: d last).
    scale = np.array([0.01], np.float16).view(np.uint8)
    blocks = raw.reshape(rows, -1, block_bytes)
    if qtype == Q.Q4_K:
        blocks[:, :, 0:2] = scale
        blocks[:, :, 2:4] = scale
    else:
        blocks[:, :, -2:] = scale
    expected = gguf.quants.dequantize(raw, qtype)
    write_gguf_with_embedding(model_dir, path, raw, qtype, c)
    _, params = load_gguf(path, np.float32)
    emb = params["params"]["embed_tokens"]["embedding"]
    assert emb.shape == (rows, 256) and np.isfinite(emb).all()
    np.testing.assert_array_equal(emb, expected)


def write_gguf_with_embedding(model_dir, path, raw, qtype, c) -> None:
    from safetensors.numpy import load_file

    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(256)
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    for name, t in sd.items():
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name != "lm_head.weight":
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            w.add_tensor(f"blk.{layer}.{_NAMES[suffix]}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_corrupt_and_missing_files_name_the_problem(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(WeightLoadError, match="bad.gguf"):
        load_checkpoint(str(bad), np.float32)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(str(tmp_path / "nope"), np.float32)


def test_missing_tensor_and_shape_mismatch_name_the_tensor(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    model_dir = save_tiny_hf("llama", str(tmp_path))
    st = os.path.join(model_dir, "model.safetensors")
    sd = load_file(st)
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"][:5]
    save_file(sd, st)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape"):
        load_checkpoint(model_dir, np.float32)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, st)
    with pytest.raises(WeightLoadError, match=r"up_proj\.weight.*missing"):
        load_checkpoint(model_dir, np.float32)


def test_unsupported_architecture_lists_supported(tmp_path) -> None:
    import json

    model_dir = save_tiny_hf("llama", str(tmp_path))
    cfg_path = os.path.join(model_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_checkpoint(model_dir, np.float32)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1])
def test_gguf_read_as_int8_tensor_by_tensor(qtype: Q, tmp_path) -> None:
    """quantization="int8" at load (one tensor at a time, q/k rows unpermuted first) gives
    exactly the whole float model quantized afterwards."""
    import jax

    from jaxserve.models.quantization import quantize_params

    model_dir = save_tiny_hf("llama", str(tmp_path))
    path = str(tmp_path / "q.gguf")
    write_gguf(model_dir, path, qtype)
    _, floats = load_gguf(path, np.float32)
    _, direct = load_gguf(path, np.float32, WeightFormat.INT8)
    want = quantize_params(floats, WeightFormat.INT8)
    assert jax.tree.structure(direct) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def _same_fields(a: gguf.GGUFReader, b: gguf.GGUFReader) -> None:
    assert list(a.fields) == list(b.fields)
    for key, fa in a.fields.items():
        fb = b.fields[key]
        assert (fa.offset, fa.data, fa.types) == (fb.offset, fb.data, fb.types), key
        assert [(p.dtype, p.shape, p.tobytes()) for p in fa.parts] == [
            (p.dtype, p.shape, p.tobytes()) for p in fb.parts], key
        assert fa.contents() == fb.contents(), key
    assert [(t.name, t.data_offset) for t in a.tensors] == [(t.name, t.data_offset) for t in b.tensors]


def test_fast_reader_parses_what_the_package_parses(tmp_path) -> None:
    """models/gguf_reader.py builds the package's parts (every array kind, empty and nested
    ones), for a written file and for the default model's own."""
    from jaxserve.models.gguf_reader import GGUFReader
    from jaxserve.models.model_files import default_model_path

    path = str(tmp_path / "kinds.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("t.strings", ["a", "", "héllo", "x" * 300])
    w.add_array("t.empty", [])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.s", "one")
    w.add_uint32("t.u", 7)
    w.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, default_model_path()):
        _same_fields(GGUFReader(p), gguf.GGUFReader(p))
