"""Load a Hugging Face model directory: config.json + *.safetensors."""

from __future__ import annotations

import functools
import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxserve.config import WeightFormat
from jaxserve.models import checkpoint_quant
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loaders.weights import WeightLoadError, build_params, projection_shapes
from jaxserve.models.model_files import read_hf_config

# safetensors' NumPy reader has no float8 types: these are read from the file's own header.
_FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


@functools.lru_cache(maxsize=8)
def _header(path: str) -> tuple[int, dict[str, Any]]:
    """(where the data starts, the JSON header) of a safetensors file, parsed once."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return 8 + size, json.loads(f.read(size))


def _read_float8(path: str, name: str) -> np.ndarray | None:
    """Tensor `name` of a safetensors file if it is a float8 one, else None."""
    data_start, header = _header(path)
    info = header.get(name)
    if not info or info.get("dtype") not in _FLOAT8:
        return None
    start, end = info["data_offsets"]  # from the end of the header
    with open(path, "rb") as f:
        f.seek(data_start + start)
        data = f.read(end - start)
    return np.frombuffer(data, _FLOAT8[info["dtype"]]).reshape(info["shape"]).copy()


def load_hf_dir(
    model_dir: str, dtype: Any, weight_format: WeightFormat = WeightFormat.FLOAT
) -> tuple[ArchConfig, dict[str, Any]]:
    """Return the architecture and the param tree of a safetensors checkpoint. A checkpoint
    stored quantized (models/checkpoint_quant.py) is read by its format's formula."""
    config = read_hf_config(model_dir)
    arch = ArchConfig.from_hf_config(config)
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
            t = _read_float8(path, name)
            if t is None:
                raise WeightLoadError(f"{path}: tensor {name!r} cannot be read ({e})") from None
            return t

    cq = checkpoint_quant.from_hf_config(config, model_dir)
    if cq is not None:
        shapes = projection_shapes(arch)
        if weight_format.from_checkpoint:  # the layers' projections are read as stored
            shapes = {k: v for k, v in shapes.items() if k == "lm_head.weight"}
        get = checkpoint_quant.dequantizing_get(get, cq, shapes, model_dir)
    return arch, build_params(arch, get, dtype, model_dir, weight_format, cq)
