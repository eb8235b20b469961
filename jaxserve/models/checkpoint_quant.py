"""Checkpoints stored quantized: their `quantization_config` (config.json) read into one typed
scheme (models/quant_scheme.py), and each projection's tensors read by the format's published
formula (`read_matrix`).

JAX-free (NumPy): the API server and the preflight read the scheme without a device.

compressed-tensors (llmcompressor's output; vLLM's main format), `w = (q - zero) * scale`:
    float-quantized   weight float8_e4m3fn [out, in]
    pack-quantized    weight_packed int32 [out, ceil(in * bits / 32)]: element i at bit i * bits
                      of the little-endian stream, stored as q + 2^(bits-1); weight_shape [2];
                      weight_zero_point packed the same way along `out` (asymmetric only)
    int-quantized / naive-quantized   weight int8 [out, in] (weight_zero_point int8)
    weight_scale      [1] (tensor), [out, 1] (channel), [out, in / group_size] (group),
                      [ceil(out / b0), ceil(in / b1)] (block)
fp8 (Qwen3-FP8, DeepSeek-V3): weight float8_e4m3fn [out, in], weight_scale_inv
    [ceil(out / b0), ceil(in / b1)] for `weight_block_size` [b0, b1]; w = weight * scale_inv.
gptq, awq: models/gptq_awq.py.
mxfp4 (GPT-OSS): only the experts are quantized, OCP Microscaling FP4 (`dequantize_mxfp4`),
    read by the GPT-OSS experts' loader (models/loaders/weights.py); the rest is float.

Activation quantization (static `input_scale`, dynamic per token) is not applied: activations
stay in the model's dtype, as vLLM does on chips without FP8 matmuls (weight-only).
"""

from __future__ import annotations

from typing import Any, cast

import ml_dtypes
import numpy as np

from jaxserve.models import gptq_awq
from jaxserve.models.quant_scheme import (
    CheckpointQuant,
    CheckpointQuantError,
    GetTensor,
    StoredMatrix,
    need_tensor,
    unpack_ints,
)

SUPPORTED = ("compressed-tensors: float-quantized FP8 weights (tensor, channel, group or block "
             "scales), pack-quantized / int-quantized / naive-quantized int4 and int8 weights "
             "(channel or group scales, symmetric or with zero points); fp8 with "
             "weight_block_size (Qwen3-FP8, DeepSeek-V3); gptq 4- and 8-bit (checkpoint_format "
             "gptq or gptq_v2, desc_act either way); awq 4-bit (version gemm); mxfp4 "
             "(GPT-OSS's experts)")
_CT_FORMATS = ("float-quantized", "pack-quantized", "int-quantized", "naive-quantized")


def from_hf_config(config: dict[str, Any], model_dir: str) -> CheckpointQuant | None:
    """The checkpoint's scheme from config.json (None: float weights). CheckpointQuantError
    names the field of a scheme jaxserve does not read, and lists what it does."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    where = f"{model_dir}: config.json quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointQuantError(f"{where}: not an object")
    method = qc.get("quant_method")
    if method == "mxfp4":  # the experts only: their loader dequantizes them (dequantize_mxfp4)
        return None
    if method == "fp8":
        return _fp8_block(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method in ("gptq", "awq"):
        return (gptq_awq.from_gptq if method == "gptq" else gptq_awq.from_awq)(qc, where)
    fields = ", ".join(f"{k}={qc[k]!r}" for k in ("bits", "group_size", "desc_act", "version",
                                                   "load_in_4bit", "load_in_8bit") if k in qc)
    raise CheckpointQuantError(
        f"{where}.quant_method {method!r}{' (' + fields + ')' if fields else ''} is not "
        f"supported. jaxserve reads {SUPPORTED}; float checkpoints and GGUF files load too "
        "(--quantization int8 or bf16 quantizes float weights at load).")


# The 16 E2M1 codes of FP4 (sign, 2 exponent bits, 1 mantissa bit).
MXFP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MXFP4_BLOCK = 32  # values per shared scale


def unpack_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str,
                 shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 (GPT-OSS's experts) -> (FP4 values float32 `shape` [..., out, in], scales float32
    [..., out, in / 32]). `blocks` uint8 [..., out, in / 32, 16]: two FP4 values a byte, the
    low nibble first; `scales` uint8 [..., out, in / 32]: each block's power of two, biased by
    127 (E8M0). CheckpointQuantError names the tensor `name`(_blocks / _scales) when they
    disagree (`check_mxfp4`)."""
    want = check_mxfp4(blocks, scales, name, shape)
    values = np.empty((*want[:-1], MXFP4_BLOCK), np.float32)
    values[..., 0::2] = MXFP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = MXFP4_VALUES[blocks >> 4]
    return values.reshape(shape), np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)


def check_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str,
                shape: tuple[int, ...]) -> tuple[int, ...]:
    """The blocks' shape a `shape` [..., out, in] weight needs; CheckpointQuantError naming
    `name`_blocks or `name`_scales where they are not that (uint8, one scale per block)."""
    *lead, n_in = shape
    want = (*lead, n_in // MXFP4_BLOCK, MXFP4_BLOCK // 2)
    if n_in % MXFP4_BLOCK or blocks.dtype != np.uint8 or tuple(blocks.shape) != want:
        raise CheckpointQuantError(
            f"{name}_blocks: {blocks.dtype} {tuple(blocks.shape)}, expected uint8 {want} "
            f"(MXFP4 blocks of {MXFP4_BLOCK} values for a {tuple(shape)} weight)")
    if scales.dtype != np.uint8 or tuple(scales.shape) != want[:-1]:
        raise CheckpointQuantError(f"{name}_scales: {scales.dtype} {tuple(scales.shape)}, "
                                   f"expected uint8 {want[:-1]} (one per block of {name}_blocks)")
    return want


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str,
                     shape: tuple[int, ...]) -> np.ndarray:
    """MXFP4 -> float32 `shape` [..., out, in] (`unpack_mxfp4`'s values times their scales)."""
    values, scale = unpack_mxfp4(blocks, scales, name, shape)
    grouped = values.reshape(*shape[:-1], -1, MXFP4_BLOCK) * scale[..., None]
    return grouped.reshape(shape)


def _fp8_block(qc: dict[str, Any], where: str) -> CheckpointQuant:
    block = qc.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointQuantError(
            f"{where}.weight_block_size: {block!r}; jaxserve reads the fp8 format with a block "
            "size [out, in] (per-tensor fp8 checkpoints: as compressed-tensors)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointQuantError(f"{where}.fmt: {qc.get('fmt')!r}; only e4m3 is read")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return CheckpointQuant("fp8", "fp8", "float", 8, "block", block=(block[0], block[1]),
                           ignore=ignore)


def _compressed_tensors(qc: dict[str, Any], where: str) -> CheckpointQuant:
    if qc.get("sparsity_config"):
        raise CheckpointQuantError(f"{where}.sparsity_config: sparse checkpoints are not supported; "
                                   f"jaxserve reads {SUPPORTED}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointQuantError(f"{where}.config_groups: missing; nothing says how weights are stored")
    schemes = []
    targets: list[str] = []
    for gname, g in groups.items():
        field = f"{where}.config_groups.{gname}"
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise CheckpointQuantError(f"{field}.weights: missing (activation-only schemes are not supported)")
        fmt = g.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise CheckpointQuantError(f"{field}.format {fmt!r} is not supported; jaxserve reads {SUPPORTED}")
        wtype, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if (wtype, bits) not in (("float", 8), ("int", 8), ("int", 4)):
            raise CheckpointQuantError(
                f"{field}.weights: type {wtype!r} with num_bits {bits!r} is not supported "
                f"(fp8, int8 and int4 are); jaxserve reads {SUPPORTED}")
        if strategy not in ("tensor", "channel", "group", "block"):
            raise CheckpointQuantError(f"{field}.weights.strategy {strategy!r} is not supported "
                                       "(tensor, channel, group and block are)")
        if w.get("actorder") not in (None, "static", "weight"):
            raise CheckpointQuantError(f"{field}.weights.actorder {w.get('actorder')!r} is not "
                                       "supported (activation-ordered groups; static is)")
        gs = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and not (isinstance(gs, int) and gs > 0):
            raise CheckpointQuantError(f"{field}.weights.group_size: {gs!r}, a positive integer expected")
        block = w.get("block_structure") if strategy == "block" else None
        if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
            raise CheckpointQuantError(f"{field}.weights.block_structure: {block!r}, [out, in] expected")
        schemes.append(CheckpointQuant(
            "compressed-tensors", fmt, cast(str, wtype), cast(int, bits), strategy, gs,  # checked above
            tuple(block) if block else None, bool(w.get("symmetric", True))))
        targets += list(g.get("targets") or ["Linear"])
    if len(set(schemes)) > 1:
        raise CheckpointQuantError(
            f"{where}.config_groups: {len(set(schemes))} different weight schemes "
            f"({'; '.join(sorted({s.name for s in schemes}))}); one per checkpoint is supported")
    return CheckpointQuant(**{**schemes[0].__dict__, "targets": tuple(targets),
                              "ignore": tuple(qc.get("ignore") or ())})


def _expand_scale(cq: CheckpointQuant, scale: np.ndarray, shape: tuple[int, int], name: str,
                  source: str) -> np.ndarray:
    """The stored scale as [out, groups] of equal groups (blocks repeated over their rows)."""
    out, n_in = shape
    scale = np.asarray(scale, np.float32)
    if cq.strategy == "tensor":
        expect: tuple[int, ...] = (1,)
    elif cq.strategy == "channel":
        expect = (out, 1)
    elif cq.strategy == "group":
        assert cq.group_size is not None  # the scheme sets it for strategy "group"
        if n_in % cq.group_size:
            raise CheckpointQuantError(
                f"{source}: tensor {name!r}: group_size {cq.group_size} does not divide the "
                f"{n_in} input features")
        expect = (out, n_in // cq.group_size)
    else:
        assert cq.block is not None  # the scheme sets it for strategy "block"
        b0, b1 = cq.block
        if n_in % b1:
            raise CheckpointQuantError(
                f"{source}: tensor {name!r}: block size {b1} does not divide the {n_in} input "
                "features (jaxserve keeps one scale per equal group of inputs)")
        expect = (-(-out // b0), n_in // b1)
    if scale.size == 1 and cq.strategy == "tensor":
        return np.full((out, 1), scale.reshape(()), np.float32)
    if tuple(scale.shape) != expect:
        raise CheckpointQuantError(
            f"{source}: tensor {name!r} has shape {tuple(scale.shape)}, expected {expect} "
            f"for {cq.name}")
    if cq.strategy == "block":
        return np.ascontiguousarray(scale[np.arange(out) // b0])
    return scale


def read_matrix(cq: CheckpointQuant, get: GetTensor, module: str, shape: tuple[int, int],
                source: str) -> StoredMatrix:
    """`module`'s stored matrix [out, in] = `shape`, checked against the scheme `cq`."""
    if cq.method in ("gptq", "awq"):
        return gptq_awq.read(cq, get, module, shape, source)
    out, n_in = shape
    scale_name = f"{module}.weight_scale_inv" if cq.method == "fp8" else f"{module}.weight_scale"
    scale = _expand_scale(cq, need_tensor(get, scale_name, source, cq), shape, scale_name, source)
    zero = None
    if cq.format == "pack-quantized":
        name = f"{module}.weight_packed"
        packed = need_tensor(get, name, source, cq)
        words = -(-n_in * cq.num_bits // 32)
        if packed.dtype != np.int32 or tuple(packed.shape) != (out, words):
            raise CheckpointQuantError(f"{source}: tensor {name!r} is {packed.dtype} {tuple(packed.shape)}, "
                                       f"expected int32 {(out, words)} for {cq.name}")
        stored_shape = get(f"{module}.weight_shape")
        if stored_shape is not None and tuple(int(x) for x in stored_shape) != shape:
            raise CheckpointQuantError(f"{source}: tensor '{module}.weight_shape' says "
                                       f"{tuple(int(x) for x in stored_shape)}, expected {shape}")
        values = unpack_ints(packed, cq.num_bits, n_in)
        if not cq.symmetric:
            zname = f"{module}.weight_zero_point"
            zp = need_tensor(get, zname, source, cq)
            zwords = -(-out * cq.num_bits // 32)
            if tuple(zp.shape) != (zwords, scale.shape[1]) or cq.strategy == "block":
                raise CheckpointQuantError(f"{source}: tensor {zname!r} has shape {tuple(zp.shape)}, "
                                           f"expected {(zwords, scale.shape[1])}")
            zero = np.ascontiguousarray(unpack_ints(np.ascontiguousarray(zp.T), cq.num_bits, out).T)
    else:
        name = f"{module}.weight"
        values = need_tensor(get, name, source, cq)
        dtype = np.dtype(ml_dtypes.float8_e4m3fn) if cq.type == "float" else np.dtype(np.int8)
        if values.dtype != dtype or tuple(values.shape) != shape:
            raise CheckpointQuantError(f"{source}: tensor {name!r} is {values.dtype} {tuple(values.shape)}, "
                                       f"expected {dtype} {shape} for {cq.name}")
        if not cq.symmetric and cq.type == "int":
            zname = f"{module}.weight_zero_point"
            zero = _expand_scale(cq, need_tensor(get, zname, source, cq), shape, zname, source).astype(np.int8)
    if cq.type == "int" and cq.symmetric is False and zero is None:
        raise CheckpointQuantError(f"{source}: {module}: zero points missing for {cq.name}")
    return StoredMatrix(np.ascontiguousarray(values), scale, zero)


def dequantizing_get(get: GetTensor, cq: CheckpointQuant, shapes: dict[str, tuple[int, int]],
                     source: str) -> GetTensor:
    """`get` with every quantized projection's `<module>.weight` read as float32 by the
    format's formula (`shapes`: HF weight name -> [out, in], the architecture's)."""

    def fetch(name: str) -> np.ndarray | None:
        module = name.removesuffix(".weight")
        if name in shapes and cq.quantizes(module):
            return read_matrix(cq, get, module, shapes[name], source).dequantize()
        return get(name)

    return fetch
