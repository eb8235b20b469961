"""GPTQ and AWQ checkpoints (AutoGPTQ / GPTQModel, AutoAWQ): their `quantization_config` read
into a CheckpointQuant (models/quant_scheme.py) and each projection's int32-packed tensors
unpacked by the format's published layout into a StoredMatrix.

JAX-free (NumPy). Values unpack unsigned q in [0, 2^bits) and are kept signed, q - 2^(bits-1),
as the other int formats are; the zero point likewise; w = (q - zero) * scale either way.

GPTQ (quant_method "gptq"), bits 4 or 8, p = 32 / bits values per int32 word:
    qweight  int32 [in / p, out]      input p*r + i at bits i*bits of row r's word
    qzeros   int32 [groups, out / p]  output p*c + i at bits i*bits; checkpoint_format "gptq"
                                      (v1) stores zero - 1 (mod 2^bits), "gptq_v2" the zero
    scales   float16 [groups, out]
    g_idx    int32 [in]               input -> group; i // group_size unless desc_act
AWQ (quant_method "awq", version "gemm"), 4 bits, zero points:
    qweight  int32 [in, out / 8]      output 8*c + ORDER[i] at bits 4*i, ORDER = 0 2 4 6 1 3 5 7
    qzeros   int32 [groups, out / 8]  the same packing
    scales   float16 [groups, out]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.models.quant_scheme import (
    CheckpointQuant,
    CheckpointQuantError,
    GetTensor,
    StoredMatrix,
    need_tensor,
    unpack_ints,
)

# Where AWQ's packing puts output 8c + j: the nibble _AWQ_NIBBLE[j] of word c.
_AWQ_NIBBLE = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def from_gptq(qc: dict[str, Any], where: str) -> CheckpointQuant:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise CheckpointQuantError(f"{where}.bits: {bits!r}; jaxserve reads 4- and 8-bit GPTQ")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"  # GPTQModel's newer name
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointQuantError(f"{where}.checkpoint_format: {fmt!r}; jaxserve reads "
                                   "'gptq' and 'gptq_v2' (Marlin, BitBLAS and other repacked "
                                   "layouts are not read)")
    # v1 stores zero - 1 in `bits` bits: a zero of 0 wraps to 2^bits - 1, read back as 0 here
    # (AutoGPTQ's kernels read it as 2^bits; such checkpoints are the v1 format's known flaw).
    if qc.get("dynamic"):
        raise CheckpointQuantError(f"{where}.dynamic: per-module overrides are not supported")
    group, strategy = _group(qc.get("group_size"), f"{where}.group_size")
    blocks = qc.get("modules_in_block_to_quantize")
    targets = tuple(m for b in blocks for m in b) if blocks else ("Linear",)
    return CheckpointQuant(
        "gptq", "gptq", "int", bits, strategy, group, symmetric=bool(qc.get("sym", True)),
        targets=targets, ignore=() if qc.get("lm_head") else ("lm_head",),
        # One group per channel: the inputs' order cannot matter, so nothing is permuted.
        desc_act=bool(qc.get("desc_act")) and group is not None, zero_offset=1 if fmt == "gptq" else 0)


def from_awq(qc: dict[str, Any], where: str) -> CheckpointQuant:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointQuantError(f"{where}.version: {qc.get('version')!r}; jaxserve reads AWQ's "
                                   "GEMM layout ('gemm'), not GEMV's or repacked ones")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise CheckpointQuantError(f"{where}.bits: {bits!r}; AWQ checkpoints are read at 4 bits")
    if qc.get("zero_point", True) is not True:
        raise CheckpointQuantError(f"{where}.zero_point: {qc.get('zero_point')!r}; jaxserve reads "
                                   "AWQ with zero points (its GEMM layout always stores them)")
    group, strategy = _group(qc.get("group_size", qc.get("q_group_size")), f"{where}.group_size")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return CheckpointQuant("awq", "awq", "int", 4, strategy, group, symmetric=False, ignore=ignore)


def _group(size: Any, field: str) -> tuple[int | None, str]:
    if size == -1:
        return None, "channel"
    if not (isinstance(size, int) and size > 0):
        raise CheckpointQuantError(f"{field}: {size!r}, a positive integer or -1 expected")
    return size, "group"


def _unpack_unsigned(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """int32 [rows, words] -> int16 [rows, n] of unsigned values, element i at bits i*bits."""
    return unpack_ints(packed, bits, n).astype(np.int16) + (1 << (bits - 1))


def read(cq: CheckpointQuant, get: GetTensor, module: str, shape: tuple[int, int],
         source: str) -> StoredMatrix:
    out, n_in = shape
    bits, per = cq.num_bits, 32 // cq.num_bits
    groups = n_in // cq.group_size if cq.group_size else 1
    if cq.group_size and n_in % cq.group_size:
        raise CheckpointQuantError(f"{source}: {module}: group_size {cq.group_size} does not "
                                   f"divide the {n_in} input features")

    def tensor(suffix: str, dtype: Any, expect: tuple[int, int]) -> np.ndarray:
        name = f"{module}.{suffix}"
        t = need_tensor(get, name, source, cq)
        if t.dtype != np.dtype(dtype) or tuple(t.shape) != expect:
            raise CheckpointQuantError(f"{source}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, "
                                       f"expected {np.dtype(dtype)} {expect} for {cq.name}")
        return t

    if cq.method == "gptq":
        if n_in % per or out % per:
            raise CheckpointQuantError(f"{source}: {module}: [{out}, {n_in}] does not pack "
                                       f"{per} values per int32 word ({cq.name})")
        q = _unpack_unsigned(np.ascontiguousarray(tensor("qweight", np.int32, (n_in // per, out)).T),
                             bits, n_in)
        z = _unpack_unsigned(tensor("qzeros", np.int32, (groups, out // per)), bits, out)
        z = (z + cq.zero_offset) % (1 << bits)
    else:
        if out % 8:
            raise CheckpointQuantError(f"{source}: {module}: {out} outputs do not pack 8 per word")

        def unpack_awq(t: np.ndarray) -> np.ndarray:  # [rows, out / 8] -> [rows, out]
            u = _unpack_unsigned(t, 4, out).reshape(t.shape[0], out // 8, 8)
            return u[:, :, _AWQ_NIBBLE].reshape(t.shape[0], out)

        q = np.ascontiguousarray(unpack_awq(tensor("qweight", np.int32, (n_in, out // 8))).T)
        z = unpack_awq(tensor("qzeros", np.int32, (groups, out // 8)))
    scales = get(f"{module}.scales")
    if (scales is None or not (scales.dtype.kind == "f" or scales.dtype.name == "bfloat16")
            or tuple(scales.shape) != (groups, out)):
        got = "missing" if scales is None else f"{scales.dtype} {tuple(scales.shape)}"
        raise CheckpointQuantError(f"{source}: tensor '{module}.scales' is {got}, expected "
                                   f"float {(groups, out)} for {cq.name}")
    scale = np.ascontiguousarray(scales.astype(np.float32).T)
    zero = np.ascontiguousarray((z - (1 << (bits - 1))).astype(np.int8).T)  # [out, groups]
    g_idx = _g_idx(cq, get, module, n_in, groups, source) if cq.method == "gptq" else None
    if cq.symmetric and zero.any():
        raise CheckpointQuantError(
            f"{source}: tensor '{module}.qzeros' holds zero points other than "
            f"{1 << (bits - 1)}, but quantization_config.sym is true")
    return StoredMatrix((q - (1 << (bits - 1))).astype(np.int8), scale,
                        None if cq.symmetric else zero, g_idx)


def _g_idx(cq: CheckpointQuant, get: GetTensor, module: str, n_in: int, groups: int,
           source: str) -> np.ndarray | None:
    """GPTQ's input -> group map where it is not in order (activation order), else None."""
    name = f"{module}.g_idx"
    g = get(name)
    if g is None:
        if cq.desc_act:
            raise CheckpointQuantError(f"{source}: tensor {name!r} is missing (desc_act needs it)")
        return None
    if tuple(g.shape) != (n_in,) or g.dtype.kind not in "iu" or g.min() < 0 or g.max() >= groups:
        raise CheckpointQuantError(f"{source}: tensor {name!r} is {g.dtype} {tuple(g.shape)} with "
                                   f"values outside [0, {groups}); expected {n_in} group indices")
    if np.array_equal(g, np.arange(n_in) // (n_in // groups)):
        return None
    if not cq.desc_act:
        raise CheckpointQuantError(f"{source}: tensor {name!r} orders the inputs' groups out of "
                                   "order, but quantization_config.desc_act is false")
    if (np.bincount(g, minlength=groups) != n_in // groups).any():
        raise CheckpointQuantError(f"{source}: tensor {name!r} puts unequal numbers of inputs "
                                   f"in its groups ({n_in // groups} each expected)")
    return g.astype(np.int32)
