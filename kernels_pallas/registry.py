"""Ragged paged-attention variants by name.

A variant is one file under `kernels_pallas/ragged_paged_attention/` that calls
`register_backend` at import time; the package imports every such file, so the parametrized
test (tests/kernels) and the benchmark (scripts/bench_kernels.py) pick a new one up with no
other edit:

    # kernels_pallas/ragged_paged_attention/my_variant.py
    register_backend("my_variant", my_attention, update_kv_cache=my_kv_write,
                     platforms=("cuda",))

Every attention function has the reference signature plus `interpret` and free tuning knobs:
    fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
       interpret=False, **tuning) -> out
and every KV write takes the tokens' cache entries already in the cache's layout
(`KVCacheLayout.pack`, kernels_pallas/kv_cache.py):
    fn(kv_pages, rows, slot_mapping, *, interpret=False) -> kv_pages
A variant may also register a `plan` (vLLM's attention-metadata builder): what it derives
from the lengths alone, built once per step and passed to every layer as `plan=`:
    plan(kv_lens, page_indices, cu_q_lens, num_seqs, *, num_tokens, page_size, **tuning)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

AttentionFn = Callable[..., Any]
KVWriteFn = Callable[..., Any]
PlanFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registered variant.

    `platforms` are the jax.export platforms it lowers for ("cpu", "cuda", "rocm", "tpu");
    tests export it for each non-CPU one. `interpretable` says whether `interpret=True` runs it
    on the CPU (the reference needs no interpreter and ignores the flag). `test_tuning` lists
    tuning dicts the tests cycle through, e.g. small blocks so that tiny test batches still
    span several programs and kv blocks.
    """

    name: str
    attention: AttentionFn
    update_kv_cache: KVWriteFn
    platforms: tuple[str, ...]
    interpretable: bool = True
    description: str = ""
    test_tuning: tuple[dict[str, Any], ...] = ({},)
    plan: PlanFn | None = None
    # Takes `kv_cache_dtype` and converts a uint8 (fp8 bits) cache itself, after gathering;
    # otherwise the dispatcher hands it the whole cache bitcast to fp8 (free on GPU and TPU).
    reads_kv_bits: bool = False
    # Its native cache is the packed (TPU) layout and it takes `layout=`; otherwise the
    # standard one. The dispatcher converts a cache of the other layout (tests, research).
    packed_layout: bool = False
    # (cache bytes read, flops) of one layer of a step, from the kernel's own block plan:
    # `step_cost(layout, num_q_heads, page_size, q_lens, kv_lens)` (preflight --roofline).
    step_cost: Callable[..., tuple[int, int]] | None = None


_BACKENDS: dict[str, Backend] = {}
# Variant files that failed to import (e.g. a jaxlib without Triton), kept so that asking for
# one says why rather than "unknown backend".
_IMPORT_ERRORS: dict[str, str] = {}


def register_backend(
    name: str,
    fn: AttentionFn,
    *,
    update_kv_cache: KVWriteFn | None = None,
    plan: PlanFn | None = None,
    platforms: tuple[str, ...] = ("cpu",),
    interpretable: bool = True,
    description: str = "",
    test_tuning: tuple[dict[str, Any], ...] = ({},),
    reads_kv_bits: bool = False,
    packed_layout: bool = False,
    step_cost: Callable[..., tuple[int, int]] | None = None,
) -> Backend:
    """Register attention variant `name` (and its KV write; default: the XLA scatter)."""
    if name in _BACKENDS and _BACKENDS[name].attention is not fn:
        raise ValueError(f"backend {name!r} is already registered; pick another name")
    if update_kv_cache is None:
        from kernels_pallas.kv_cache import update_kv_cache as xla_write

        def update_kv_cache(kv_pages, rows, slot_mapping, *, interpret: bool = False):
            del interpret  # XLA scatter runs anywhere
            return xla_write(kv_pages, rows, slot_mapping)

    backend = Backend(name, fn, update_kv_cache, tuple(platforms), interpretable, description,
                      tuple(test_tuning), plan, reads_kv_bits, packed_layout, step_cost)
    _BACKENDS[name] = backend
    return backend


def get_backend(name: str) -> Backend:
    """The registered variant `name`, or an error listing what exists."""
    try:
        return _BACKENDS[name]
    except KeyError:
        if name in _IMPORT_ERRORS:
            raise ValueError(
                f"backend {name!r} failed to import: {_IMPORT_ERRORS[name]}"
            ) from None
        raise ValueError(
            f"unknown attention backend {name!r}; registered: {', '.join(list_backends())}"
        ) from None


def list_backends() -> list[str]:
    """Names of all registered variants, the reference first."""
    return sorted(_BACKENDS, key=lambda n: (n != "reference", n))


def record_import_error(module: str, error: BaseException) -> None:
    _IMPORT_ERRORS[module] = f"{type(error).__name__}: {error}"
