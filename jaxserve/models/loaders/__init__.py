"""Load any supported checkpoint into (ArchConfig, Flax param tree of NumPy arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.config import WeightFormat
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loaders.weights import WeightLoadError
from jaxserve.models.model_files import ModelFiles, ModelFormat, resolve_model


def load_checkpoint(
    model: str | ModelFiles | None, dtype: Any, weight_format: WeightFormat = WeightFormat.FLOAT,
    experts_format: WeightFormat | None = None,
) -> tuple[ArchConfig, dict[str, Any]]:
    """Read weights as host NumPy arrays in `dtype`; the worker places them.

    With a quantized `weight_format` (int8, bf16) the projections and embedding come back in that format
    (models/quantization.py), quantized one tensor at a time as they are read (GGUF and
    safetensors; an Orbax checkpoint is restored whole, then quantized). `experts_format`:
    the experts' own (ResolvedConfig.experts_weight_format; safetensors only).
    """
    files = model if isinstance(model, ModelFiles) else resolve_model(model)
    dtype = np.dtype(dtype)
    if files.format == ModelFormat.GGUF:
        from jaxserve.models.loaders.gguf_loader import load_gguf

        return load_gguf(files.path, dtype, weight_format)
    if files.format == ModelFormat.HF:
        from jaxserve.models.loaders.hf import load_hf_dir

        return load_hf_dir(files.path, dtype, weight_format, files.hf_overrides, experts_format)
    from jaxserve.models.loaders.orbax_loader import read_orbax_arch, restore_orbax
    from jaxserve.models.quantization import quantize_params

    return read_orbax_arch(files.path), quantize_params(restore_orbax(files.path, dtype), weight_format)


def read_arch(model: str | ModelFiles | None) -> ArchConfig:
    """The checkpoint's architecture, without reading its weights."""
    files = model if isinstance(model, ModelFiles) else resolve_model(model)
    if files.format == ModelFormat.GGUF:
        from jaxserve.models.loaders.gguf_loader import gguf_arch_config, read_gguf

        return gguf_arch_config(read_gguf(files.path), files.path)[0]
    if files.format == ModelFormat.HF:
        from jaxserve.models.loaders.hf import read_hf_config

        return ArchConfig.from_hf_config(read_hf_config(files.path, files.hf_overrides))
    from jaxserve.models.loaders.orbax_loader import read_orbax_arch

    return read_orbax_arch(files.path)


__all__ = ["load_checkpoint", "read_arch", "WeightLoadError"]
