"""`gguf.GGUFReader` with its arrays parsed at numpy's speed, the same fields to the byte.

The package's reader parses a metadata array element by element, three numpy views per
element and a Python call per view: the default model's 49,152-token vocabulary and 48,900
merges took 3.4-3.9 s of every engine start and of every API server start. This subclass
walks an array's offsets with `struct` and builds the very parts the package builds (a
`uint64` length and a `uint8` view per string, a one-element view per scalar), so every
consumer (`ReaderField.contents`, transformers' GGUF converter, our loader) reads the same
values. Files in the other byte order keep the package's own parse.

JAX-free: the API server reads EOS ids and tokenizers through it.
"""

from __future__ import annotations

import struct
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType


class GGUFReader(gguf.GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = GGUFValueType(raw_itype[0]), int(alen[0])
        offs = orig_offs + 12
        parts: list[Any] = [raw_itype, alen]
        types = [GGUFValueType.ARRAY, itype] if n else [GGUFValueType.ARRAY]
        # Views of a plain ndarray: np.memmap's own slicing runs Python per view.
        data = self.data.view(np.ndarray)
        scalar = self.gguf_scalar_to_np.get(itype)
        if scalar is not None:
            values = data[offs:offs + n * np.dtype(scalar).itemsize].view(scalar)
            parts += [values[i:i + 1] for i in range(n)]
            return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), types
        if itype != GGUFValueType.STRING:  # nested arrays: the package's recursive parse
            return super()._get_field_parts(orig_offs, raw_type)
        unpack, u64 = struct.Struct("<Q").unpack_from, np.dtype("<u8")
        # Its memoryview (no copy): numpy's stubs give ndarray `__buffer__` on Python 3.12+ only.
        buf = data.data
        for _ in range(n):
            (length,) = unpack(buf, offs)
            parts.append(data[offs:offs + 8].view(u64))
            parts.append(data[offs + 8:offs + 8 + length])
            offs += 8 + length
        return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), types
