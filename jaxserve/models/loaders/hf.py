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

from jaxserve.classifier import ClassifierConfig
from jaxserve.config import WeightFormat
from jaxserve.models import checkpoint_quant
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loaders.weights import GetTensor, WeightLoadError, build_params, projection_shapes
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


# Where image-and-text checkpoints (models/architectures.py's TEXT_DECODER_OF) keep the text
# decoder's weights that a text model keeps under `model.`.
_TEXT_DECODER_PREFIX = "model.language_model."


def load_hf_dir(
    model_dir: str, dtype: Any, weight_format: WeightFormat = WeightFormat.FLOAT,
    hf_overrides: str | None = None, experts_format: WeightFormat | None = None,
) -> tuple[ArchConfig, dict[str, Any]]:
    """Return the architecture and the param tree of a safetensors checkpoint. A checkpoint
    stored quantized (models/checkpoint_quant.py) is read by its format's formula."""
    config = read_hf_config(model_dir, hf_overrides)
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
            where[key] = (h, path, key)
            if key.startswith(_TEXT_DECODER_PREFIX):  # an image-and-text checkpoint's decoder
                where["model." + key.removeprefix(_TEXT_DECODER_PREFIX)] = (h, path, key)

    def read(name: str) -> np.ndarray | None:
        if name not in where:
            return None
        h, path, stored = where[name]
        try:
            return h.get_tensor(stored)
        except Exception as e:
            t = _read_float8(path, stored)
            if t is None:
                raise WeightLoadError(f"{path}: tensor {name!r} cannot be read ({e})") from None
            return t

    get: GetTensor = read
    cq = checkpoint_quant.from_hf_config(config, model_dir)
    if cq is not None:
        shapes = projection_shapes(arch)
        if weight_format.from_checkpoint:  # the layers' projections are read as stored
            shapes = {k: v for k, v in shapes.items() if k == "lm_head.weight"}
        get = checkpoint_quant.dequantizing_get(get, cq, shapes, model_dir)
    return arch, build_params(arch, get, dtype, model_dir, weight_format, cq, experts_format)


def load_score_head(model_dir: str, classifier: ClassifierConfig, hidden_size: int) -> np.ndarray:
    """A classifier's head, float32 [num_labels, hidden_size]: `score.weight`, or for a causal
    LM converted by `classifier_from_token` the lm_head's rows of those tokens (the embedding's
    if the head is tied): "from_2_way_softmax" gives one row, true's minus false's."""
    names = ("lm_head.weight", "model.embed_tokens.weight") if classifier.from_token_ids \
        else ("score.weight",)
    where: dict[str, str] = {}
    for file in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, file), framework="numpy") as h:
            where.update((n, os.path.join(model_dir, file)) for n in names if n in h.keys())
    name = next((n for n in names if n in where), None)
    if name is not None:
        path = where[name]
        with safe_open(path, framework="numpy") as h:
            shape = tuple(h.get_slice(name).get_shape())
            if len(shape) != 2 or shape[1] != hidden_size or (
                    not classifier.from_token_ids and shape[0] != classifier.num_labels):
                want = "(vocab, " if classifier.from_token_ids else f"({classifier.num_labels}, "
                raise WeightLoadError(f"{path}: {name} is {shape}, expected {want}{hidden_size})")
            if not classifier.from_token_ids:
                return np.asarray(h.get_tensor(name), np.float32)
            if max(classifier.from_token_ids) >= shape[0]:
                raise WeightLoadError(f"{path}: classifier_from_token's ids "
                                      f"{list(classifier.from_token_ids)} exceed {name}'s {shape[0]} rows")
            rows = np.stack([np.asarray(h.get_slice(name)[i:i + 1], np.float32)[0]
                             for i in classifier.from_token_ids])
            return rows[1:2] - rows[0:1] if classifier.method == "from_2_way_softmax" else rows
    raise WeightLoadError(f"{model_dir}: no {' or '.join(names)} tensor for the classifier's head")
