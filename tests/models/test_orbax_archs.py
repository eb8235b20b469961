"""`python -m jaxserve.convert` of the newer architectures (a mixture of experts, Gemma 3's
mixed layer kinds): the Orbax copy gives transformers' logits and, through the engine,
its greedy tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.models import LlamaForCausalLM
from jaxserve.models.loaders import load_checkpoint, read_arch
from tests.models.forward import prompt_logits
from tests.models.test_gemma import PROMPTS, hf_greedy, tiny_gemma
from tests.models.tiny import hf_logits, save_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma3"])
def test_orbax_conversion_of_newer_architectures(kind: str, tmp_path) -> None:
    from jaxserve import LLM, SamplingParams

    src = (tiny_gemma(kind, str(tmp_path)) if kind == "gemma3"
           else save_tiny_hf(kind, str(tmp_path)))
    dst = str(tmp_path / "orbax")
    subprocess.run([sys.executable, "-m", "jaxserve.convert", "--model", src, "--output", dst,
                    "--skip-tokenizer-init"], cwd=ROOT, check=True, capture_output=True,
                   timeout=600)
    arch, params = load_checkpoint(dst, np.float32)
    assert arch == read_arch(src) and hash(arch)  # layer kinds and all, hashable for jit
    for ids in PROMPTS:
        ours = prompt_logits(LlamaForCausalLM(arch), params, ids)
        assert np.abs(ours - hf_logits(src, ids)).max() <= 1e-4
    llm = LLM(dst, skip_tokenizer_init=True, max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=16, block_size=4, kv_cache_memory_bytes=4 << 20,
              enforce_eager=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(src, PROMPTS, 8)
