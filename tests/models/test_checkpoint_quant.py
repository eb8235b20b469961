"""Checkpoints stored quantized (models/checkpoint_quant.py) against references our loader never
touched: tests/data/quantized holds tiny checkpoints llmcompressor wrote (compressed-tensors
FP8 per tensor, per channel and per block, W8A16, W4A16 with and without zero points, a
Qwen3-MoE with int4 experts); one in the block-wise `fp8` format and four in GPTQ's and AWQ's
layouts written from known integers. Each has reference.json: transformers' prompt logprobs and
greedy tokens on the weights compressed-tensors itself decompressed, or on the integers
dequantized by the format's formula (scripts/make_quantized_checkpoints.py,
scripts/make_gptq_awq_checkpoints.py)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized")
CHECKPOINTS = sorted(os.listdir(DATA))
PROMPT = list(range(3, 40))
GREEDY_PROMPT = list(range(3, 11))
ENGINE = dict(max_model_len=128, max_num_seqs=4, skip_tokenizer_init=True, max_num_batched_tokens=64,
              kv_cache_memory_bytes=4 << 20, enforce_eager=True)


def _reference(name: str) -> dict:
    with open(os.path.join(DATA, name, "reference.json")) as f:
        return json.load(f)


def _engine_run(model_dir: str, **kw) -> tuple[list[float], list[int], object]:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model_dir, **ENGINE, **kw)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": GREEDY_PROMPT}],
            [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
        worker = llm.engine.worker
        info = (worker.weight_format, worker.model_options.weight_group_size)
    finally:
        llm.shutdown()
    logprobs = [next(iter(p.values())).logprob for p in outs[0].prompt_logprobs[1:]]
    return logprobs, list(outs[1].outputs[0].token_ids), info


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_engine_matches_the_dequantized_reference(name: str) -> None:
    """Through the engine on the CPU in float32: int checkpoints served as int8 values with the
    checkpoint's groups (exact; GPTQ's activation order with its inputs permuted); fp8 ones
    and 8-bit values with zero points dequantized at load. Greedy tokens equal, prompt logprobs within 2e-3 (the issue's
    bound; today within 1e-5)."""
    from jaxserve.config import WeightFormat
    from jaxserve.models.checkpoint_quant import from_hf_config

    ref = _reference(name)
    logprobs, greedy, (fmt, group) = _engine_run(os.path.join(DATA, name), cpu_auto_bf16=False)
    assert greedy == ref["greedy"]
    assert np.abs(np.array(logprobs) - ref["prompt_logprobs"]).max() < 2e-3
    cq = from_hf_config(json.load(open(os.path.join(DATA, name, "config.json"))), name)
    if "fp8" in name or "int8-asym" in name:
        assert fmt is WeightFormat.FLOAT  # no fp8 matmul on the CPU / no kernel: dequantized at load
    else:
        assert fmt is WeightFormat.CHECKPOINT_INT8
        assert group == cq.group_size
    lib = ref.get("library_dequantized")  # GPTQ / AWQ: gptqmodel's own reading of the tensors
    if lib is not None:
        assert np.abs(np.array(logprobs) - lib["prompt_logprobs"]).max() < 2e-3
    # transformers running the quantized checkpoint itself quantizes activations too (the
    # fp8 schemes' dynamic input quantization; gptqmodel's fp16 kernels): logprobs near.
    own = ref.get("transformers_quantized")
    if own is not None:
        assert np.abs(np.array(own["prompt_logprobs"]) - ref["prompt_logprobs"]).max() < 0.1


@pytest.mark.parametrize("name,fmt,group", [
    ("llama-fp8-dynamic", "checkpoint fp8", None), ("llama-fp8-tensor", "checkpoint fp8", None),
    ("llama-fp8-block", "checkpoint fp8", 64), ("llama-fp8-blockwise", "checkpoint fp8", 64),
    ("llama-w4a16", "checkpoint int4", 32), ("llama-w4a16-asym", "checkpoint int8", 32),
    ("llama-gptq", "checkpoint int4", 32), ("llama-awq", "checkpoint int8", 32),
    ("llama-awq", "checkpoint int4 zero points", 32),
    ("llama-w4a16-asym", "checkpoint int4 zero points", 32),
    ("llama-gptq-actorder", "checkpoint int4 zero points", 32),
    ("llama-gptq-actorder", "checkpoint int8", 32),
])
def test_stored_width_formats_are_the_dequantized_model(name: str, fmt: str, group: int | None) -> None:
    """The formats GPU and TPU serve (fp8 and int4 values in HBM, widened inside the dot), run
    here through XLA on the CPU: the leaves keep the stored width, the logits are the
    reference's."""
    import jax
    import ml_dtypes

    from jaxserve.config import WeightFormat
    from jaxserve.models import LlamaForCausalLM
    from jaxserve.models.attention import ModelOptions
    from jaxserve.models.loaders import load_checkpoint
    from tests.models.forward import prompt_logits

    weight_format = WeightFormat(fmt)
    cfg, params = load_checkpoint(os.path.join(DATA, name), np.float32, weight_format)
    q = params["params"]["layers"]["mlp"]["down_proj"]
    assert q["qweight"].dtype == np.dtype(getattr(ml_dtypes, weight_format.values_dtype, np.int8))
    assert q["qweight"].shape == (2, cfg.hidden_size, cfg.intermediate_size)
    assert q["scale"].shape[-1] == (cfg.intermediate_size // group if group else 1)
    assert "kernel" in params["params"]["lm_head"]  # left unquantized by the checkpoint
    model = LlamaForCausalLM(cfg, ModelOptions(weight_format=weight_format, weight_group_size=group,
                                               weight_act_order="actorder" in name))
    if "actorder" in name:  # its inputs sorted into their groups: a permutation, not the identity
        perm = params["params"]["layers"]["self_attn"]["q_proj"]["perm"]
        assert perm.shape == (2, cfg.hidden_size) and (np.sort(perm, -1) == np.arange(cfg.hidden_size)).all()
        assert (perm != np.arange(cfg.hidden_size)).any()
    lp = jax.nn.log_softmax(prompt_logits(model, params, PROMPT), -1)
    ours = [float(lp[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]
    assert np.abs(np.array(ours) - _reference(name)["prompt_logprobs"]).max() < 1e-4


def test_tensor_parallel_shards_the_stored_scales() -> None:
    """GPTQ (int4, symmetric) and AWQ (zero points) at their stored width on 2 fake devices:
    the scales split with their output channels, greedy tokens as on one device and as the
    dequantized reference. GPTQ's activation order is dequantized at load under TP."""
    from tests.models.tiny import on_fake_devices

    for name in ("llama-gptq", "llama-awq", "llama-gptq-actorder"):
        got = on_fake_devices(os.path.join(DATA, name), [[1, False, "stored"], [2, False, "stored"]],
                              [GREEDY_PROMPT])
        one, two = got["tp1-ep0-stored"], got["tp2-ep0-stored"]
        assert one["tokens"][0][:12] == two["tokens"][0][:12] == _reference(name)["greedy"], name
        assert one["weight_format"] == "checkpoint int8"
        if "actorder" in name:
            assert two["weight_format"] == "float"
        else:
            assert two["weight_format"] == "checkpoint int8"
            assert two["q_proj_scale_spec"] == "P(None, 'model', None)", two  # [layers, out, groups]


def test_preflight_counts_the_stored_width() -> None:
    """Weights in memory are the stored bytes: a Llama-3-8B shape (config alone) as FP8 per
    channel and as W4A16 group 128, for a TPU, with float embedding and LM head as stored."""
    import jax

    from jaxserve.config import WeightFormat
    from jaxserve.models import ArchConfig, LlamaForCausalLM
    from jaxserve.models.attention import ModelOptions
    from jaxserve.models.quantization import param_bytes
    from jaxserve.parallel.pipeline import abstract_params

    arch = ArchConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False))
    projections = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    head_embed = 2 * 128256 * 4096 * 2  # bf16
    for fmt, group, bits in (("checkpoint fp8", None, 8), ("checkpoint int4", 128, 4)):
        opts = ModelOptions(dtype=jax.numpy.bfloat16, weight_format=WeightFormat(fmt),
                            weight_group_size=group)
        stored = projections * bits // 8 + head_embed
        got = param_bytes(abstract_params(LlamaForCausalLM(arch, opts)))
        assert stored <= got <= 1.05 * stored, (fmt, got / stored)


def _copy(name: str, tmp_path) -> str:
    path = str(tmp_path / name)
    shutil.copytree(os.path.join(DATA, name), path)
    return path


def _edit_tensors(path: str, edit) -> None:
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _edit_config(path: str, edit) -> None:
    file = os.path.join(path, "config.json")
    cfg = json.load(open(file))
    edit(cfg["quantization_config"])
    json.dump(cfg, open(file, "w"))


def test_bad_checkpoints_are_start_up_errors_naming_the_tensor_and_field(tmp_path) -> None:
    """A missing scale, a group size that does not divide, a shape mismatch and an unknown
    quant_method: each a ValueError at load naming what is wrong, never a crash mid-load."""
    from jaxserve.models.loaders import load_checkpoint

    def load(path: str) -> str:
        with pytest.raises(ValueError) as e:
            load_checkpoint(path, np.float32)
        return str(e.value)

    missing = _copy("llama-w4a16", tmp_path)
    _edit_tensors(missing, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    assert "'model.layers.1.mlp.up_proj.weight_scale' is missing" in load(missing)

    shape = _copy("llama-w8a16", tmp_path)
    def bad_shape(t):
        t["model.layers.0.self_attn.k_proj.weight_scale"] = t["model.layers.0.self_attn.k_proj.weight_scale"][:3]
    _edit_tensors(shape, bad_shape)
    msg = load(shape)
    assert "'model.layers.0.self_attn.k_proj.weight_scale' has shape (3, 1), expected (64, 1)" in msg

    group = _copy("llama-w4a16-asym", tmp_path)
    _edit_config(group, lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=48))
    assert "group_size 48 does not divide the 128 input features" in load(group)

    other = _copy("llama-fp8-dynamic", tmp_path / "bnb")
    _edit_config(other, lambda qc: qc.update(quant_method="bitsandbytes", load_in_4bit=True))
    msg = load(other)
    assert "quant_method 'bitsandbytes' (" in msg and "load_in_4bit=True) is not supported" in msg
    assert all(f in msg for f in ("compressed-tensors", "weight_block_size", "gptq", "awq"))

    # GPTQ and AWQ: a missing or misshapen packed tensor, a config its tensors contradict,
    # a layout or width not read
    gptq = _copy("llama-gptq", tmp_path / "gptq-missing")
    _edit_tensors(gptq, lambda t: t.pop("model.layers.1.self_attn.o_proj.qzeros"))
    assert "'model.layers.1.self_attn.o_proj.qzeros' is missing (gptq int4" in load(gptq)
    gptq = _copy("llama-gptq", tmp_path / "gptq-shape")
    def transposed(t):
        t["model.layers.0.mlp.up_proj.qweight"] = t["model.layers.0.mlp.up_proj.qweight"].T.copy()
    _edit_tensors(gptq, transposed)
    assert "'model.layers.0.mlp.up_proj.qweight' is int32 (256, 16), expected int32 (16, 256)" in load(gptq)
    order = _copy("llama-gptq-actorder", tmp_path / "gptq-order")
    _edit_config(order, lambda qc: qc.update(desc_act=False))
    assert "g_idx' orders the inputs' groups out of order, but quantization_config.desc_act is false" in load(order)
    sym = _copy("llama-awq", tmp_path / "awq-gemv")
    _edit_config(sym, lambda qc: qc.update(version="gemv"))
    assert "quantization_config.version: 'gemv'; jaxserve reads AWQ's GEMM layout" in load(sym)
    from jaxserve.models.checkpoint_quant import from_hf_config  # GPTQModel's newer `format`
    for qc, offset in (({"format": "gptq_v2"}, 0), ({"checkpoint_format": "gptq"}, 1), ({}, 1)):
        cq = from_hf_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, **qc}}, "d")
        assert cq.zero_offset == offset, qc
    bits3 = _copy("llama-gptq", tmp_path / "gptq-bits")
    _edit_config(bits3, lambda qc: qc.update(bits=3))
    assert "quantization_config.bits: 3; jaxserve reads 4- and 8-bit GPTQ" in load(bits3)

    bits = _copy("llama-fp8-dynamic", tmp_path / "bits")
    _edit_config(bits, lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="int", num_bits=3))
    assert "config_groups.group_0.weights: type 'int' with num_bits 3 is not supported" in load(bits)
