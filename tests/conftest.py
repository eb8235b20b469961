"""Shared test setup: JAX on the CPU in float32 (no bf16 weights by default), with the persistent
compilation cache."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's references are float32: `--dtype auto` keeps float32 weights on CPUs with bf16
# units too (tests/models/test_cpu_default.py holds the bf16 default).
os.environ.setdefault("JAXSERVE_CPU_AUTO_BF16", "0")

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    try:
        import jax
    except ImportError:  # host-only test runs
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cache = os.environ.get("JAXSERVE_TEST_COMPILATION_CACHE", os.path.join(base, "jaxserve", "jax_test_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the default model's GGUF (float32): the reference."""
    import torch
    import transformers

    from jaxserve.models.model_files import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()
