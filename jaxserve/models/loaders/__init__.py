"""Load any supported checkpoint into (ArchConfig, Flax param tree of NumPy arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.model_files import ModelFiles, ModelFormat, resolve_model
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loaders.weights import WeightLoadError


def load_checkpoint(model: str | ModelFiles | None, dtype: Any) -> tuple[ArchConfig, dict[str, Any]]:
    """Read weights as host NumPy arrays in `dtype`; the worker places them."""
    files = model if isinstance(model, ModelFiles) else resolve_model(model)
    dtype = np.dtype(dtype)
    if files.format == ModelFormat.GGUF:
        from jaxserve.models.loaders.gguf_loader import load_gguf

        return load_gguf(files.path, dtype)
    if files.format == ModelFormat.HF:
        from jaxserve.models.loaders.hf import load_hf_dir

        return load_hf_dir(files.path, dtype)
    from jaxserve.models.loaders.orbax_loader import read_orbax_arch, restore_orbax

    return read_orbax_arch(files.path), restore_orbax(files.path, dtype)


__all__ = ["load_checkpoint", "WeightLoadError"]
