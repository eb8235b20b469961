"""JAX's persistent compilation cache, on by default under the user's cache directory."""

from __future__ import annotations

import os

import jax

from jaxserve.models.tokenizer import cache_dir

# Cache every program that took noticeable time: on the CPU even 0.3 s adds up.
MIN_CACHED_COMPILE_S = 0.3


def enable_compilation_cache(path: str | None = None) -> str:
    """Point JAX at a persistent cache (unless the user already did) and return its path."""
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # set at run time
    if current:
        return current
    path = path or os.path.join(cache_dir(), "jax_compilation_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)
    return path
