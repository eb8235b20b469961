"""One host-to-device upload per compiled program per step: named fields packed in one buffer.

A step's inputs are a dozen small arrays (token ids, positions, slot mapping, lengths, the
page table rows, sampling parameters). Sent one by one they are a dozen transfers, each a
round of host work and, on a GPU/TPU, a separate DMA; packed, they are one. The layout is
static (a hashable `Packing`, part of the program's bucket), so unpacking inside the jitted
program is free slicing:

    int32 buffer  | input_ids[T] | positions[T] | ... | page_indices[Q * P] | ...
                    floats and uint32s travel bitcast to int32, bools as 0/1
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_KINDS = {"i32": np.int32, "u32": np.uint32, "f32": np.float32, "bool": np.bool_}


@dataclass(frozen=True)
class Packing:
    """Fields as (name, shape, kind); kind in i32, u32, f32, bool."""

    fields: tuple[tuple[str, tuple[int, ...], str], ...]

    @functools.cached_property
    def _spans(self) -> tuple[tuple[str, tuple[int, ...], str, int, int], ...]:
        """(name, shape, kind, start, end) of every field."""
        spans, offset = [], 0
        for name, shape, kind in self.fields:
            n = int(np.prod(shape))
            spans.append((name, shape, kind, offset, offset + n))
            offset += n
        return tuple(spans)

    @property
    def size(self) -> int:
        return self._spans[-1][4] if self.fields else 0

    def pack(self, values: dict[str, Any]) -> np.ndarray:
        """Host arrays (each of its field's shape) -> one int32 buffer."""
        buf = np.empty(self.size, np.int32)
        for name, _, kind, start, end in self._spans:
            a: np.ndarray = np.asarray(values[name], _KINDS[kind]).reshape(end - start)
            buf[start:end] = a.astype(np.int32) if kind == "bool" else a.view(np.int32)
        return buf

    def unpack(self, buf: jax.Array) -> dict[str, jax.Array]:
        """The int32 buffer -> named device arrays (inside a jitted program)."""
        out: dict[str, jax.Array] = {}
        for name, shape, kind, start, end in self._spans:
            a = buf[start:end].reshape(shape)
            if kind == "bool":
                a = a != 0
            elif kind != "i32":
                a = jax.lax.bitcast_convert_type(a, jnp.dtype(_KINDS[kind]))
            out[name] = a
        return out
