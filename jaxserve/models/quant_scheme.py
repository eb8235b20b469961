"""What a checkpoint stored quantized is, whichever format stores it: its scheme
(`CheckpointQuant`), a projection as stored (`StoredMatrix`), the error that names a tensor or
field jaxserve cannot read, and the tensor helpers every format's reader shares
(models/checkpoint_quant.py: compressed-tensors and fp8; models/gptq_awq.py: GPTQ and AWQ).

JAX-free (NumPy).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

GetTensor = Callable[[str], "np.ndarray | None"]


class CheckpointQuantError(ValueError):
    """A quantized checkpoint jaxserve cannot read, or one whose tensors contradict its config."""


@dataclass(frozen=True)
class CheckpointQuant:
    """One weight scheme for every quantized projection of a checkpoint."""

    method: str  # "compressed-tensors" | "fp8" | "gptq" | "awq"
    format: str  # a compressed-tensors format (checkpoint_quant._CT_FORMATS), or the method
    type: str  # "float" (float8_e4m3fn) | "int"
    num_bits: int  # 8, or 4 (int)
    strategy: str  # "tensor" | "channel" | "group" | "block"
    group_size: int | None = None  # strategy "group"
    block: tuple[int, int] | None = None  # strategy "block": [out, in] per scale
    symmetric: bool = True
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    desc_act: bool = False  # gptq: inputs may join their groups out of order (g_idx)
    zero_offset: int = 0  # gptq v1 stores each zero point minus one

    @property
    def name(self) -> str:
        """How logs and errors name it, e.g. 'compressed-tensors int4 (group 128, symmetric)'."""
        width = "fp8" if self.type == "float" else f"int{self.num_bits}"
        how = {"group": f"group {self.group_size}", "block": f"block {self.block}"}.get(
            self.strategy, f"per {self.strategy}")
        zero = "" if self.type == "float" else (", symmetric" if self.symmetric else ", zero points")
        return f"{self.method} {width} ({how}{zero})"

    def quantizes(self, module: str) -> bool:
        """Whether `module` (e.g. 'model.layers.0.self_attn.q_proj') is stored quantized."""
        if any(matches(module, t) for t in self.ignore):
            return False
        return any(t == "Linear" or matches(module, t) for t in self.targets)


@dataclass(frozen=True)
class StoredMatrix:
    """A projection as stored: `values` [out, in] (int8 holding int4/int8 values, or
    float8_e4m3fn), `scale` float32 [out, groups] over equal groups of `in // groups` inputs,
    `zero` int8 [out, groups] or None. w = (values - zero) * scale per group. `g_idx` [in]:
    each input's group where they are not in order (GPTQ's activation order; float only)."""

    values: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None
    g_idx: np.ndarray | None = None

    def as_leaves(self, values_dtype: str, zero_points: bool = False,
                  act_order: bool = False) -> dict[str, np.ndarray]:
        """The model's leaves for a checkpoint format (models/quantization.py): `qweight`
        [out, in] in `values_dtype` ("int8", "int4", "float8_e4m3fn") and `scale` [out, groups];
        with `zero_points` also `zero_scale` float32 [out, groups] (zero times scale), else
        `qweight` holds the values minus zero points (which int8 holds exactly for int4).
        With `act_order` also `perm` int32 [in]: the inputs sorted by group, the order of
        `qweight`'s columns (GPTQ's g_idx made contiguous groups, as vLLM's Marlin path does)."""
        values, leaves = self.values, {}
        if act_order:
            n_in = values.shape[1]
            perm = np.argsort(self.g_idx, kind="stable") if self.g_idx is not None else np.arange(n_in)
            values, leaves["perm"] = values[:, perm], perm.astype(np.int32)
        elif self.g_idx is not None:
            raise ValueError("inputs grouped out of order (g_idx) need act_order")
        dtype = np.dtype(getattr(ml_dtypes, values_dtype, values_dtype))
        if zero_points:
            zero = self.zero if self.zero is not None else np.zeros(self.scale.shape, np.int8)
            return {"qweight": np.ascontiguousarray(values.astype(dtype)), "scale": self.scale,
                    "zero_scale": zero.astype(np.float32) * self.scale, **leaves}
        if self.zero is not None:
            if values_dtype != "int8":
                raise ValueError(f"{values_dtype} values hold no zero points")
            g = values.shape[1] // self.zero.shape[1]
            values = (values.astype(np.int16) - np.repeat(self.zero, g, axis=1)).astype(np.int8)
        return {"qweight": np.ascontiguousarray(values.astype(dtype)), "scale": self.scale, **leaves}

    def dequantize(self) -> np.ndarray:
        out, n_in = self.values.shape
        if self.g_idx is not None:
            q = self.values.astype(np.float32)
            if self.zero is not None:
                q = q - self.zero.astype(np.float32)[:, self.g_idx]
            return q * self.scale[:, self.g_idx]
        g = n_in // self.scale.shape[1]
        q = self.values.astype(np.float32).reshape(out, -1, g)
        if self.zero is not None:
            q = q - self.zero.astype(np.float32)[..., None]
        return (q * self.scale[..., None]).reshape(out, n_in)


def matches(module: str, target: str) -> bool:
    """Whether `module` is `target` (a module name, its last parts, or "re:" a regex)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def need_tensor(get: GetTensor, name: str, source: str, cq: CheckpointQuant) -> np.ndarray:
    """The tensor `name`; CheckpointQuantError naming what needs it where it is missing."""
    t = get(name)
    if t is None:
        raise CheckpointQuantError(f"{source}: tensor {name!r} is missing ({cq.name} needs it)")
    return t


def unpack_ints(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """int32 [rows, words] -> int8 [rows, n]: element i at bit i * bits of each row's
    little-endian stream, stored as value + 2^(bits - 1)."""
    stream = np.ascontiguousarray(packed.astype("<i4")).view(np.uint8)
    if bits == 4:
        stream = np.stack([stream & 0xF, stream >> 4], axis=-1).reshape(packed.shape[0], -1)
    return (stream[:, :n].astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
