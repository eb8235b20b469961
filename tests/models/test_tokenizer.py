"""The GGUF tokenizer we build (no torch) equals transformers' own GGUF loading."""

from __future__ import annotations

import os

from jaxserve.models.model_files import default_model_path
from jaxserve.models.tokenizer import tokenizer_from_gguf

TEXTS = ["Hello world, how are you?", "  leading spaces\n\ttabs and émojis 🌊", "def f(x):\n    return x**2"]


def test_gguf_tokenizer_matches_transformers() -> None:
    from transformers import AutoTokenizer

    path = default_model_path()
    ours = tokenizer_from_gguf(path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids
        ids = ref(text).input_ids
        assert ours.decode(ids) == ref.decode(ids)
    chat = [{"role": "user", "content": "Hi!"}]
    kw = dict(tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat, **kw) == ref.apply_chat_template(chat, **kw)
    assert ours.eos_token_id == ref.eos_token_id == 2
