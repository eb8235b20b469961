"""The CPU's default weight format: bf16 weights under `--dtype auto` where oneDNN drives the
CPU's bf16 units natively (AVX512-BF16 / AMX), float32 elsewhere; and how far the default
model's default configuration stays from transformers' float32 (the suite's other tests pin
float32 weights: tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import CPU_AUTO_BF16_ENV, CPU_PACKED_WEIGHTS_ENV, WeightFormat
from jaxserve.engine import resolve as resolve_mod
from jaxserve.engine.arg_utils import make_engine_config
from jaxserve.engine.resolve import resolve_packed_weights, resolve_quantization
from jaxserve.models import ArchConfig

_SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
# resolve_quantization takes the architecture as a reader (called only when it matters).
def DENSE() -> ArchConfig:
    return ArchConfig(architecture="LlamaForCausalLM", **_SHAPE)


def MOE() -> ArchConfig:
    return ArchConfig(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, **_SHAPE)


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch):
    """Pretend oneDNN's bf16 matmul is native here (the rule, apart from this CPU)."""
    monkeypatch.setattr(resolve_mod.bf16_kernel.cpu, "onednn_available", lambda: True)


def test_auto_gives_bf16_weights_only_to_dense_single_device_cpu_models(native_bf16, monkeypatch) -> None:
    assert resolve_quantization(None, "auto", "cpu", 1, 1, DENSE)[0] == "bf16"
    assert resolve_quantization("int8", "auto", "cpu", 1, 1, DENSE)[0] == "int8"  # asked for
    for args, why in [(("float32", "cpu", 1, 1, DENSE), "--dtype float32"),
                      (("auto", "tpu", 1, 1, DENSE), "on tpu"),
                      (("auto", "gpu", 1, 1, DENSE), "on gpu"),
                      (("auto", "cpu", 2, 1, DENSE), "tensor/pipeline"),
                      (("auto", "cpu", 1, 2, DENSE), "tensor/pipeline"),
                      (("auto", "cpu", 1, 1, MOE), "mixture-of-experts")]:
        quant, reason = resolve_quantization(None, *args)
        assert quant is None and why in reason, (args, reason)
    assert resolve_quantization(None, "auto", "cpu", 1, 1, DENSE, cpu_auto_bf16=False) == (
        None, f"--no-cpu-auto-bf16 (or {CPU_AUTO_BF16_ENV}=0)")


def test_the_cpu_switches_are_flags_with_documented_environment_overrides(monkeypatch) -> None:
    # The environment is read once, by the resolution stage, into the config's fields; an
    # explicit flag wins over it.
    for env, field in ((CPU_AUTO_BF16_ENV, "cpu_auto_bf16"),
                       (CPU_PACKED_WEIGHTS_ENV, "cpu_packed_weights")):
        monkeypatch.delenv(env, raising=False)
        assert getattr(make_engine_config().model_config, field) is True
        assert getattr(make_engine_config(**{field: False}).model_config, field) is False
        monkeypatch.setenv(env, "0")
        assert getattr(make_engine_config().model_config, field) is False
        assert getattr(make_engine_config(**{field: True}).model_config, field) is True


def test_auto_keeps_float32_without_native_bf16(monkeypatch) -> None:
    monkeypatch.setattr(resolve_mod.bf16_kernel.cpu, "onednn_available", lambda: False)
    quant, reason = resolve_quantization(None, "auto", "cpu", 1, 1, DENSE)
    assert quant is None and "no native bf16 matmul" in reason


def test_bf16_weights_are_packed_for_onednn_only_on_one_cpu_device(monkeypatch) -> None:
    monkeypatch.setattr(resolve_mod.bf16_kernel, "packing_available", lambda: True)
    bf16, int8, floats = WeightFormat.BF16, WeightFormat.INT8, WeightFormat.FLOAT
    assert resolve_packed_weights(bf16, "cpu", 1, 1)
    for args in [(floats, "cpu", 1, 1), (int8, "cpu", 1, 1), (bf16, "tpu", 1, 1), (bf16, "gpu", 1, 1),
                 (bf16, "cpu", 2, 1), (bf16, "cpu", 1, 2)]:
        assert not resolve_packed_weights(*args), args
    assert not resolve_packed_weights(bf16, "cpu", 1, 1, allowed=False)
    monkeypatch.setattr(resolve_mod.bf16_kernel, "packing_available", lambda: False)
    assert not resolve_packed_weights(bf16, "cpu", 1, 1)


PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
]
NEW_TOKENS = 48


@pytest.mark.slow
def test_default_configuration_stays_near_transformers(hf_default_model, monkeypatch) -> None:
    """The default model as `LLM()` runs it on this CPU (bf16 weights where native, else
    float32) reads transformers' float32 greedy continuations: its top-1 token (prompt
    logprobs, rank 1) must agree at >= 97% of positions, and its own greedy decode must
    repeat transformers' first 8 tokens on most prompts."""
    import torch

    from jaxserve import LLM, SamplingParams
    from jaxserve.models.tokenizer import load_tokenizer
    from kernels_pallas.bf16_matmul import cpu

    # The suite sets cpu_auto_bf16 off; eager: the programs these steps use, compiled on first
    # use (the numerics are the warm-up's; what warm-up compiles, test_llm_default_model holds).
    llm = LLM(max_model_len=512, max_num_seqs=4, cpu_auto_bf16=True, enforce_eager=True)
    try:
        expected = "bf16" if cpu.onednn_available() else None
        assert llm.engine.worker.weight_format.quantization == expected
        assert llm.engine.worker.weight_format.packed == (expected == "bf16")
        tok = load_tokenizer(None)
        agree = total = same_start = 0
        for text in PROMPTS:
            chat = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
            ids = tok.encode(chat, add_special_tokens=False)
            with torch.no_grad():
                out = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                                do_sample=False)
            ref = out[0, len(ids):].tolist()
            forced = llm.generate([{"prompt_token_ids": ids + ref}],
                                  SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
            # prompt_logprobs[i] scores token i given tokens < i; rank 1 is our top-1 there.
            ours = [next(t for t, lp in d.items() if lp.rank == 1)
                    for d in forced.prompt_logprobs[len(ids):]]
            agree += int(np.sum(np.array(ours) == np.array(ref)))
            total += len(ref)
            greedy = llm.generate([{"prompt_token_ids": ids}],
                                  SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
            same_start += list(greedy.outputs[0].token_ids) == ref[:8]
        print(f"weights {expected or 'float32'}: top-1 agreement {agree}/{total}, "
              f"first 8 greedy tokens equal on {same_start}/{len(PROMPTS)} prompts")
        assert agree >= 0.97 * total
        assert same_start >= len(PROMPTS) - 1
    finally:
        llm.shutdown()
