"""Shared test setup: JAX on the CPU in float32 (no bf16 weights by default), with the persistent
compilation cache."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's references are float32: `--dtype auto` keeps float32 weights on CPUs with bf16
# units too (tests/models/test_cpu_default.py holds the bf16 default).
os.environ.setdefault("JAXSERVE_CPU_AUTO_BF16", "0")

import pytest  # noqa: E402

# Every compiled CPU program maps memory of its own: one engine's ~50 programs take ~10,000
# of the process's memory maps, and the kernel allows 65,530 (vm.max_map_count): past it, JAX's
# next load of a compiled program from the persistent cache segfaults (CI of stop 67, 96% in,
# when each dropped LLM sat in a reference cycle until the cyclic collector ran). A dropped
# LLM frees its engine at once now (test_llm_default_model.py holds it); the kernel tests'
# jitted functions stay in JAX's caches for the process (~190 maps a test).
MAX_MAPS = 16_384


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bound_memory_maps() -> Iterator[None]:
    """After each test file, once the process holds many maps: collect what was dropped,
    then, if that was not enough, empty JAX's caches of compiled programs (later files load
    theirs from the persistent cache). Between files, so no test sees a program recompile."""
    yield
    if _memory_maps() > MAX_MAPS:
        gc.collect()
        if _memory_maps() > MAX_MAPS and "jax" in sys.modules:
            sys.modules["jax"].clear_caches()
            gc.collect()


# The files that take longest, longest first (a full run's --durations, summed per file).
# scripts/test.sh gives pytest-xdist whole files in collection order (--no-loadscope-reorder:
# by default it orders them by test count, which put these few-test files last, one worker
# running the last of them while the other idled); longest first, the run ends on short ones.
# test_llm_default_model.py leads: its warm-up compiles the default model's programs at the
# servers' settings, which the servers of test_engine_death.py and test_debug.py (warmed up
# too) and every eager one then load from the run's persistent cache rather than compiling
# them again beside it.
LONGEST_FILES = [
    "tests/worker/test_llm_default_model.py",
    "tests/device_compile/test_device_compile.py",
    "tests/models/test_moe.py",
    "tests/parallel/test_parallel.py",
    "tests/api_server/test_engine_death.py",
    "tests/worker/test_spec_decode_default_model.py",
    "tests/kernels/test_ragged_paged_attention.py",
    "tests/models/test_gpt_oss.py",
    "tests/api_server/test_server.py",
    "tests/models/test_gemma.py",
    "tests/worker/test_attention_backends.py",
    "tests/models/test_checkpoint_quant.py",
    "tests/api_server/test_debug.py",
    "tests/models/test_cpu_default.py",
    "tests/models/test_qwen3_next.py",
    "tests/test_device_check.py",
    "tests/api_server/test_bad_inputs.py",
    "tests/models/test_rope_scaling.py",
    "tests/kernels/test_kv_cache_layout.py",
    "tests/api_server/test_tiny_checkpoints.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


def pytest_configure(config: pytest.Config) -> None:
    try:
        import jax

        from jaxserve.worker.compile_cache import MIN_CACHED_COMPILE_S
    except ImportError:  # host-only test runs
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cache = os.environ.get("JAXSERVE_TEST_COMPILATION_CACHE", os.path.join(base, "jaxserve", "jax_test_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)
    # One cache for the run: the servers, engine processes and tools the tests start read
    # JAX's settings from the environment, so a program an in-process LLM compiled is a cache
    # hit for a server of the same configuration, and the other way round.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_CACHED_COMPILE_S))


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
