"""Tokenizers and chat templates from a model's own files (JAX-free).

A GGUF file carries its tokenizer and chat template in its metadata.
transformers converts it in ~6 s, so the converted tokenizer is cached on disk,
keyed by the file's path, size and mtime; later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from jaxserve.model_files import ModelFiles, ModelFormat, resolve_model


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve")


def _gguf_cache_key(path: str) -> str:
    st = os.stat(path)
    raw = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def load_tokenizer(model: str | ModelFiles | None) -> Any:
    """A Hugging Face fast tokenizer for `model` (None = the default model)."""
    from transformers import AutoTokenizer

    files = model if isinstance(model, ModelFiles) else resolve_model(model)
    if files.format != ModelFormat.GGUF:
        return AutoTokenizer.from_pretrained(files.path)
    cached = os.path.join(cache_dir(), "tokenizers", _gguf_cache_key(files.path))
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(files.path), gguf_file=os.path.basename(files.path)
    )
    tmp = f"{cached}.tmp{os.getpid()}"
    tok.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        os.replace(tmp, cached)  # atomic: concurrent loaders never see half a cache
    except OSError:
        pass  # another process won the race; its copy is equivalent
    return AutoTokenizer.from_pretrained(cached)
