"""Load a Hugging Face model directory: config.json + *.safetensors."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from safetensors import safe_open

from jaxserve.config import WeightFormat
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loaders.weights import WeightLoadError, build_params
from jaxserve.models.model_files import read_hf_config


def load_hf_dir(
    model_dir: str, dtype: Any, weight_format: WeightFormat = WeightFormat.FLOAT
) -> tuple[ArchConfig, dict[str, Any]]:
    """Return the architecture and the param tree of a safetensors checkpoint."""
    arch = ArchConfig.from_hf_config(read_hf_config(model_dir))
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    where: dict[str, Any] = {}
    handles = []
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            h = safe_open(path, framework="numpy")
        except Exception as e:  # safetensors raises its own error types
            raise WeightLoadError(f"{path}: cannot read safetensors file ({e})") from None
        handles.append(h)
        for key in h.keys():
            where[key] = (h, path)

    def get(name: str) -> np.ndarray | None:
        if name not in where:
            return None
        h, path = where[name]
        try:
            return h.get_tensor(name)
        except Exception as e:
            raise WeightLoadError(f"{path}: tensor {name!r} cannot be read ({e})") from None

    return arch, build_params(arch, get, dtype, model_dir, weight_format)
