"""Tokenizers and chat templates from a model's own files (JAX-free).

A GGUF file carries its tokenizer and chat template in its metadata. We read
them with the `gguf` package and hand them to transformers' own GGUF tokenizer
converter (its file reader needs torch, which serving does not install). The
conversion takes seconds, so the result is cached on disk, keyed by the file's
path, size and mtime; later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from jaxserve.models.model_files import ModelFiles, ModelFormat, open_gguf, resolve_model


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve")


def _gguf_cache_key(path: str) -> str:
    st = os.stat(path)
    raw = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def load_tokenizer(model: str | ModelFiles | None) -> Any:
    """A Hugging Face fast tokenizer for `model` (None = the default model)."""
    files = model if isinstance(model, ModelFiles) else resolve_model(model)
    if files.format != ModelFormat.GGUF:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(files.path)
    # What tokenizer_from_gguf saved is a PreTrainedTokenizerFast: loaded as one, transformers
    # skips its model registry (AutoTokenizer imports torch where it is installed: 3 s a start).
    from transformers import PreTrainedTokenizerFast

    cached = os.path.join(cache_dir(), "tokenizers", _gguf_cache_key(files.path))
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(cached)
    tok = tokenizer_from_gguf(files.path)
    tmp = f"{cached}.tmp{os.getpid()}"
    tok.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        os.replace(tmp, cached)  # atomic: concurrent loaders never see half a cache
    except OSError:
        pass  # another process won the race; its copy is equivalent
    return PreTrainedTokenizerFast.from_pretrained(cached)


def tokenizer_from_gguf(path: str) -> Any:
    """Build a fast tokenizer (with chat template and special tokens) from GGUF metadata."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = open_gguf(path)

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    groups = {
        group: {name: field(f"tokenizer.{key}") for key, name in renames.items()
                if f"tokenizer.{key}" in reader.fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = field(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[token_id]
    backend, _ = convert_gguf_tokenizer(field("general.architecture"), tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)
