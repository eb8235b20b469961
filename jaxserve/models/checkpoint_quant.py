"""Checkpoints stored quantized: their `quantization_config` (config.json) read into one typed
scheme, and each projection's tensors read by the format's published formula.

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

import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

GetTensor = Callable[[str], "np.ndarray | None"]

SUPPORTED = ("compressed-tensors: float-quantized FP8 weights (tensor, channel, group or block "
             "scales), pack-quantized / int-quantized / naive-quantized int4 and int8 weights "
             "(channel or group scales, symmetric or with zero points); fp8 with "
             "weight_block_size (Qwen3-FP8, DeepSeek-V3); gptq 4- and 8-bit (checkpoint_format "
             "gptq or gptq_v2, desc_act either way); awq 4-bit (version gemm); mxfp4 "
             "(GPT-OSS's experts)")
_CT_FORMATS = ("float-quantized", "pack-quantized", "int-quantized", "naive-quantized")


class CheckpointQuantError(ValueError):
    """A quantized checkpoint jaxserve cannot read, or one whose tensors contradict its config."""


@dataclass(frozen=True)
class CheckpointQuant:
    """One weight scheme for every quantized projection of a checkpoint."""

    method: str  # "compressed-tensors" | "fp8" | "gptq" | "awq"
    format: str  # one of _CT_FORMATS, or the method
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
        if any(_matches(module, t) for t in self.ignore):
            return False
        return any(t == "Linear" or _matches(module, t) for t in self.targets)

    def read(self, get: GetTensor, module: str, shape: tuple[int, int], source: str) -> StoredMatrix:
        """`module`'s stored matrix [out, in] = `shape`, checked against this scheme."""
        return _read(self, get, module, shape, source)


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


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


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
        from jaxserve.models import gptq_awq

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
            "compressed-tensors", fmt, wtype, bits, strategy, gs,
            tuple(block) if block else None, bool(w.get("symmetric", True))))
        targets += list(g.get("targets") or ["Linear"])
    if len(set(schemes)) > 1:
        raise CheckpointQuantError(
            f"{where}.config_groups: {len(set(schemes))} different weight schemes "
            f"({'; '.join(sorted({s.name for s in schemes}))}); one per checkpoint is supported")
    return CheckpointQuant(**{**schemes[0].__dict__, "targets": tuple(targets),
                              "ignore": tuple(qc.get("ignore") or ())})


def _unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """int32 [rows, words] -> int8 [rows, n]: element i at bit i * bits of each row's
    little-endian stream, stored as value + 2^(bits - 1)."""
    stream = np.ascontiguousarray(packed.astype("<i4")).view(np.uint8)
    if bits == 4:
        stream = np.stack([stream & 0xF, stream >> 4], axis=-1).reshape(packed.shape[0], -1)
    return (stream[:, :n].astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


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
        if n_in % cq.group_size:
            raise CheckpointQuantError(
                f"{source}: tensor {name!r}: group_size {cq.group_size} does not divide the "
                f"{n_in} input features")
        expect = (out, n_in // cq.group_size)
    else:
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
        return np.ascontiguousarray(scale[np.arange(out) // cq.block[0]])
    return scale


def _need(get: GetTensor, name: str, source: str, cq: CheckpointQuant) -> np.ndarray:
    t = get(name)
    if t is None:
        raise CheckpointQuantError(f"{source}: tensor {name!r} is missing ({cq.name} needs it)")
    return t


def _read(cq: CheckpointQuant, get: GetTensor, module: str, shape: tuple[int, int],
          source: str) -> StoredMatrix:
    if cq.method in ("gptq", "awq"):
        from jaxserve.models import gptq_awq

        return gptq_awq.read(cq, get, module, shape, source)
    out, n_in = shape
    scale_name = f"{module}.weight_scale_inv" if cq.method == "fp8" else f"{module}.weight_scale"
    scale = _expand_scale(cq, _need(get, scale_name, source, cq), shape, scale_name, source)
    zero = None
    if cq.format == "pack-quantized":
        name = f"{module}.weight_packed"
        packed = _need(get, name, source, cq)
        words = -(-n_in * cq.num_bits // 32)
        if packed.dtype != np.int32 or tuple(packed.shape) != (out, words):
            raise CheckpointQuantError(f"{source}: tensor {name!r} is {packed.dtype} {tuple(packed.shape)}, "
                                       f"expected int32 {(out, words)} for {cq.name}")
        stored_shape = get(f"{module}.weight_shape")
        if stored_shape is not None and tuple(int(x) for x in stored_shape) != shape:
            raise CheckpointQuantError(f"{source}: tensor '{module}.weight_shape' says "
                                       f"{tuple(int(x) for x in stored_shape)}, expected {shape}")
        values = _unpack(packed, cq.num_bits, n_in)
        if not cq.symmetric:
            zname = f"{module}.weight_zero_point"
            zp = _need(get, zname, source, cq)
            zwords = -(-out * cq.num_bits // 32)
            if tuple(zp.shape) != (zwords, scale.shape[1]) or cq.strategy == "block":
                raise CheckpointQuantError(f"{source}: tensor {zname!r} has shape {tuple(zp.shape)}, "
                                           f"expected {(zwords, scale.shape[1])}")
            zero = np.ascontiguousarray(_unpack(np.ascontiguousarray(zp.T), cq.num_bits, out).T)
    else:
        name = f"{module}.weight"
        values = _need(get, name, source, cq)
        dtype = np.dtype(ml_dtypes.float8_e4m3fn) if cq.type == "float" else np.dtype(np.int8)
        if values.dtype != dtype or tuple(values.shape) != shape:
            raise CheckpointQuantError(f"{source}: tensor {name!r} is {values.dtype} {tuple(values.shape)}, "
                                       f"expected {dtype} {shape} for {cq.name}")
        if not cq.symmetric and cq.type == "int":
            zname = f"{module}.weight_zero_point"
            zero = _expand_scale(cq, _need(get, zname, source, cq), shape, zname, source).astype(np.int8)
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
            return cq.read(get, module, shapes[name], source).dequantize()
        return get(name)

    return fetch
