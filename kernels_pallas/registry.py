"""Ragged paged-attention variants by name, and the contract every variant keeps.

A variant is one file under `kernels_pallas/ragged_paged_attention/` that calls
`register_backend` at import time; the package imports every such file, so the parametrized
test (tests/kernels) and the benchmark (scripts/bench_kernels.py) pick a new one up with no
other edit:

    # kernels_pallas/ragged_paged_attention/my_variant.py
    @dataclasses.dataclass(frozen=True)
    class MyTuning:  # block sizes and the like: how fast, never what is computed
        block_q: int = 32

    register_backend("my_variant", my_attention, update_kv_cache=my_kv_write,
                     platforms=("cuda",), test_tuning=(MyTuning(), MyTuning(block_q=2)))

What a call computes travels in one frozen, hashable `AttentionSpec` (a static argument of
`jax.jit`); how fast it runs, in the variant's own frozen tuning record. Every attention
function is an `AttentionFn`:

    fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, spec: AttentionSpec,
       sinks=None, plan=None, interpret=False, tuning: MyTuning | None = None) -> out

`sinks` (float32 [num_q_heads], GPT-OSS's) are weights, so an array argument, never part of
the spec; `tuning=None` is the variant's defaults. The variant sees the cache the dispatcher
hands it: for a `packed_layout` variant `spec.layout` is the cache's (packed) layout; for a
`reads_kv_bits` one `spec.kv_cache_dtype` names the values a uint8 / uint16 cache holds as bits
("auto": values); any other gets values ("auto", `spec.layout` None). Every KV write is a
`KVWriteFn` and takes the tokens' cache entries already in the cache's layout
(`KVCacheLayout.pack`, kernels_pallas/kv_cache.py):

    fn(kv_pages, rows, slot_mapping, *, interpret=False) -> kv_pages

A variant may also register a `PlanFn` (vLLM's attention-metadata builder): what it derives
from the lengths alone, built once per step and passed to every layer as `plan=`:

    plan(kv_lens, page_indices, cu_q_lens, num_seqs, *, num_tokens, page_size, spec,
         tuning=None)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import jax
import numpy as np

from kernels_pallas.kv_cache import KV_VALUE_DTYPES, KVCacheLayout
from kernels_pallas.kv_cache import update_kv_cache as _xla_kv_write

# A large negative *finite* number: with -inf a fully masked block would give
# exp(-inf - (-inf)) = nan in the online-softmax rescale.
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# The per-step work plan a variant's `PlanFn` builds: a pytree of arrays only its own
# attention function reads (opaque to the dispatcher and the model).
VariantPlan = Any


def _real(name: str, value: object) -> float:
    """`value` as a Python float (a static argument), or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"AttentionSpec.{name} must be a finite Python number (a static "
                         f"argument, not an array), got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What an attention call computes (its math), apart from how fast (a variant's tuning).

    Frozen and hashable: the Pallas kernels take it as a static argument of `jax.jit`.
    `sliding_window=W` lets a query at position p see keys p-W+1..p; `soft_cap=c` applies
    `c * tanh(s / c)` to the scores (Gemma 2); `k_scale` / `v_scale` multiply the cached
    keys / values back (a low-precision cache stores k / k_scale); `mask_value` is the score of
    a masked key (finite: see DEFAULT_MASK_VALUE). `kv_cache_dtype` / `layout` describe the
    cache (module docstring): to `kernels_pallas.ragged_paged_attention`, the cache given (a
    packed cache needs its `layout`); to a variant, the cache the dispatcher hands it.
    """

    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None
    k_scale: float | None = None
    v_scale: float | None = None
    mask_value: float = DEFAULT_MASK_VALUE
    kv_cache_dtype: str = "auto"
    layout: KVCacheLayout | None = None

    def __post_init__(self) -> None:
        # NOTE: numbers become Python floats so that equal specs hash equal (one compile).
        set_field = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_field("sm_scale", _real("sm_scale", self.sm_scale))
        if self.sm_scale <= 0:
            raise ValueError(f"AttentionSpec.sm_scale must be positive, got {self.sm_scale}")
        for name in ("soft_cap", "k_scale", "v_scale"):
            value = getattr(self, name)
            if value is not None:
                set_field(name, _real(name, value))
                if getattr(self, name) <= 0:
                    raise ValueError(f"AttentionSpec.{name} must be positive or None, got {value}")
        window = self.sliding_window
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
                raise ValueError(f"AttentionSpec.sliding_window must be a positive int or None, "
                                 f"got {window!r}")
            set_field("sliding_window", int(window))
        set_field("mask_value", _real("mask_value", self.mask_value))
        if self.mask_value >= 0:
            raise ValueError(f"AttentionSpec.mask_value must be negative, got {self.mask_value}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_VALUE_DTYPES:
            raise ValueError(f"AttentionSpec.kv_cache_dtype must be 'auto' or one of "
                             f"{', '.join(KV_VALUE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.layout is not None and not isinstance(self.layout, KVCacheLayout):
            raise ValueError(f"AttentionSpec.layout must be a KVCacheLayout or None, got "
                             f"{type(self.layout).__name__}")


# A variant's tuning record type. Contravariant in the protocols (a function taking any
# tuning stands in for one taking MyTuning); invariant in Backend.
_TuningIn = TypeVar("_TuningIn", contravariant=True)
TuningT = TypeVar("TuningT")


class AttentionFn(Protocol[_TuningIn]):
    """A variant's attention: see the module docstring."""

    def __call__(
        self,
        q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
        kv_pages: jax.Array,  # [num_pages, page_size, *layout.token_shape]
        kv_lens: jax.Array,  # int32[max_num_seqs]
        page_indices: jax.Array,  # int32[max_num_seqs, pages_per_seq]
        cu_q_lens: jax.Array,  # int32[max_num_seqs + 1]
        num_seqs: jax.Array,  # int32[1]
        /,
        *,
        spec: AttentionSpec,
        sinks: jax.Array | None = None,
        plan: VariantPlan = None,
        interpret: bool = False,
        tuning: _TuningIn | None = None,
    ) -> jax.Array: ...


class KVWriteFn(Protocol):
    """A variant's KV write: `rows` [num_tokens, *layout.token_shape] at flat slots."""

    def __call__(self, kv_pages: jax.Array, rows: jax.Array, slot_mapping: jax.Array, /, *,
                 interpret: bool = False) -> jax.Array: ...


class PlanFn(Protocol[_TuningIn]):
    """A variant's per-step plan (vLLM's attention-metadata builder): lengths in, plan out."""

    def __call__(self, kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                 num_seqs: jax.Array, /, *, num_tokens: int, page_size: int,
                 spec: AttentionSpec, tuning: _TuningIn | None = None) -> VariantPlan: ...


_F = TypeVar("_F", bound=Callable[..., Any])


def jit_kernel(*, static_argnames: tuple[str, ...]) -> Callable[[_F], _F]:
    """`jax.jit` that keeps the function's signature for the type checker (a jitted function
    is typed `(*args, **kwargs)`, so a registration would check nothing)."""
    def wrap(fn: _F) -> _F:
        return jax.jit(fn, static_argnames=static_argnames)  # type: ignore[return-value]
    return wrap


@dataclasses.dataclass(frozen=True)
class Backend(Generic[TuningT]):
    """One registered variant.

    `platforms` are the jax.export platforms it lowers for ("cpu", "cuda", "rocm", "tpu");
    tests export it for each non-CPU one. `interpretable` says whether `interpret=True` runs it
    on the CPU (the reference needs no interpreter and ignores the flag). `test_tuning` lists
    tuning records the tests cycle through (None: the defaults), e.g. small blocks so that
    tiny test batches still span several programs and kv blocks.
    """

    name: str
    attention: AttentionFn[TuningT]
    update_kv_cache: KVWriteFn
    platforms: tuple[str, ...]
    interpretable: bool = True
    description: str = ""
    test_tuning: tuple[TuningT | None, ...] = (None,)
    plan: PlanFn[TuningT] | None = None
    # Converts a uint8 (fp8 bits) or uint16 cache itself after gathering (`spec.kv_cache_dtype`
    # names the values); otherwise the dispatcher hands it the whole cache bitcast to values
    # (free on GPU and TPU).
    reads_kv_bits: bool = False
    # Its native cache is the packed (TPU) layout, named by `spec.layout`; otherwise the
    # standard one. The dispatcher converts a cache of the other layout (tests, research).
    packed_layout: bool = False
    # (cache bytes read, flops) of one layer of a step, from the kernel's own block plan:
    # `step_cost(layout, num_q_heads, page_size, q_lens, kv_lens)` (preflight --roofline).
    step_cost: Callable[..., tuple[int, int]] | None = None


_BACKENDS: dict[str, Backend[Any]] = {}
# Variant files that failed to import (e.g. a jaxlib without Triton), kept so that asking for
# one says why rather than "unknown backend".
_IMPORT_ERRORS: dict[str, str] = {}


def register_backend(
    name: str,
    fn: AttentionFn[TuningT],
    *,
    update_kv_cache: KVWriteFn | None = None,
    plan: PlanFn[TuningT] | None = None,
    platforms: tuple[str, ...] = ("cpu",),
    interpretable: bool = True,
    description: str = "",
    test_tuning: tuple[TuningT | None, ...] = (None,),
    reads_kv_bits: bool = False,
    packed_layout: bool = False,
    step_cost: Callable[..., tuple[int, int]] | None = None,
) -> Backend[TuningT]:
    """Register attention variant `name` (and its KV write; default: the XLA scatter)."""
    if name in _BACKENDS and _BACKENDS[name].attention is not fn:
        raise ValueError(f"backend {name!r} is already registered; pick another name")
    if update_kv_cache is None:
        def update_kv_cache(kv_pages: jax.Array, rows: jax.Array, slot_mapping: jax.Array, /, *,
                            interpret: bool = False) -> jax.Array:
            del interpret  # XLA scatter runs anywhere
            return _xla_kv_write(kv_pages, rows, slot_mapping)

    backend = Backend(name, fn, update_kv_cache, tuple(platforms), interpretable, description,
                      tuple(test_tuning), plan, reads_kv_bits, packed_layout, step_cost)
    _BACKENDS[name] = backend
    return backend


def get_backend(name: str) -> Backend[Any]:
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
