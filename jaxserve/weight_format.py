"""The weights a model runs with: --quantization's methods and the resolved WeightFormat
(jaxserve/engine/resolve.py decides it; models/quantization.py and the loaders act on it).

This module never imports JAX (the engine core and API server read it).
"""

from __future__ import annotations

import enum

QUANTIZATION_METHODS = ("int8", "bf16")


def check_quantization(method: str | None) -> None:
    """Raise ValueError naming the field when `method` is not one we implement."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), got {method!r}"
        )


class WeightFormat(enum.Enum):
    """The weights a model runs with (resolved from --dtype, --quantization and the platform)."""

    FLOAT = "float"  # the model dtype's own float weights
    INT8 = "int8"  # --quantization int8
    BF16 = "bf16"  # bfloat16 weights, float32 activations (--quantization bf16, the CPU's default)
    BF16_PACKED = "bf16 packed"  # the same, packed at load into oneDNN's layout (the CPU)
    # A checkpoint stored quantized (models/checkpoint_quant.py), its projections' values and
    # scales served as stored (embeddings and LM head in the model dtype):
    CHECKPOINT_INT8 = "checkpoint int8"  # int8 values (int4 ones with zero points widened)
    CHECKPOINT_INT4 = "checkpoint int4"
    CHECKPOINT_INT4_ZP = "checkpoint int4 zero points"  # int4 values, zero points times scales (AWQ)
    CHECKPOINT_FP8 = "checkpoint fp8"  # float8_e4m3fn
    # GPT-OSS's experts at 4 bits: FP4 (E2M1) values, a power-of-two scale per 32 inputs
    # (models/checkpoint_quant.py); only ever an experts' format (ResolvedConfig). Each scale
    # kept as the checkpoint stores it, its biased exponent (uint8, E8M0); the values float4,
    # or (GPUs, where XLA copied a float4 stack whole) two a byte as stored.
    CHECKPOINT_MXFP4 = "checkpoint mxfp4"
    CHECKPOINT_MXFP4_PACKED = "checkpoint mxfp4 packed"

    @classmethod
    def of(cls, quantization: str | None) -> WeightFormat:
        """The format --quantization names (None: the float weights)."""
        check_quantization(quantization)
        return {None: cls.FLOAT, "int8": cls.INT8, "bf16": cls.BF16}[quantization]

    @property
    def quantization(self) -> str | None:
        """The --quantization name of this format (logs and JSON reports)."""
        return {WeightFormat.INT8: "int8", WeightFormat.BF16: "bf16",
                WeightFormat.BF16_PACKED: "bf16", WeightFormat.CHECKPOINT_INT8: "int8",
                WeightFormat.CHECKPOINT_INT4: "int4", WeightFormat.CHECKPOINT_INT4_ZP: "int4",
                WeightFormat.CHECKPOINT_FP8: "fp8", WeightFormat.CHECKPOINT_MXFP4: "mxfp4",
                WeightFormat.CHECKPOINT_MXFP4_PACKED: "mxfp4"}.get(self)

    @property
    def quantized(self) -> bool:
        """Not the model dtype's floats: converted at load from the checkpoint's floats
        (models/quantization.py), or read as the checkpoint stores them."""
        return self is not WeightFormat.FLOAT

    @property
    def from_checkpoint(self) -> bool:
        """The checkpoint's own quantized values, read as stored."""
        return self in (WeightFormat.CHECKPOINT_INT8, WeightFormat.CHECKPOINT_INT4,
                        WeightFormat.CHECKPOINT_INT4_ZP, WeightFormat.CHECKPOINT_FP8,
                        WeightFormat.CHECKPOINT_MXFP4, WeightFormat.CHECKPOINT_MXFP4_PACKED)

    @property
    def scaled(self) -> bool:
        """Values times a scale per output channel and group of inputs (`qweight`, `scale`)."""
        return self is WeightFormat.INT8 or self.from_checkpoint

    @property
    def values_dtype(self) -> str:  # a scaled format's `qweight` (JAX's and ml_dtypes' name)
        return {WeightFormat.CHECKPOINT_INT4: "int4", WeightFormat.CHECKPOINT_INT4_ZP: "int4",
                WeightFormat.CHECKPOINT_FP8: "float8_e4m3fn",
                WeightFormat.CHECKPOINT_MXFP4: "float4_e2m1fn",
                WeightFormat.CHECKPOINT_MXFP4_PACKED: "uint8"}.get(self, "int8")

    @property
    def values_per_byte(self) -> int:  # a scaled format's values in one `qweight` element
        return 2 if self is WeightFormat.CHECKPOINT_MXFP4_PACKED else 1

    @property
    def scale_dtype(self) -> str:  # a scaled format's `scale`
        return "uint8" if self.mxfp4 else "float32"

    @property
    def mxfp4(self) -> bool:
        return self in (WeightFormat.CHECKPOINT_MXFP4, WeightFormat.CHECKPOINT_MXFP4_PACKED)

    @property
    def zero_points(self) -> bool:
        """Each group's values less its zero point: a `zero_scale` leaf [out, groups] beside
        `scale`, zero times scale in the model's dtype (models/quantization.py's Int8Dense)."""
        return self is WeightFormat.CHECKPOINT_INT4_ZP

    @property
    def bf16(self) -> bool:
        return self in (WeightFormat.BF16, WeightFormat.BF16_PACKED)

    @property
    def packed(self) -> bool:
        """bf16 weights packed at load for oneDNN (quantization.pack_params)."""
        return self is WeightFormat.BF16_PACKED
