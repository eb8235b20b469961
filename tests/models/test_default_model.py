"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers'
own GGUF loader, in float32: top-1 equal at every position, max |diff| <= 2e-3."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxserve.models import LlamaForCausalLM
from jaxserve.models.loaders import load_checkpoint
from jaxserve.models.tokenizer import load_tokenizer
from tests.models.forward import prompt_logits

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def test_default_model_matches_transformers(hf_default_model) -> None:
    import torch

    t0 = time.perf_counter()
    arch, params = load_checkpoint(None, np.float32)
    load_s = time.perf_counter() - t0
    print(f"default model load: {load_s:.2f} s")
    assert arch.num_hidden_layers == 30 and arch.num_key_value_heads == 3
    tok = load_tokenizer(None)
    model = LlamaForCausalLM(arch)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    for text in [*PROMPTS, chat]:
        ids = tok(text).input_ids
        ours = prompt_logits(model, params, ids)
        with torch.no_grad():
            ref = hf_default_model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
        assert np.abs(ours - ref).max() <= 2e-3
