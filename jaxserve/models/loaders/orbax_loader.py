"""Converted Orbax checkpoints: `python -m jaxserve.convert` writes them, the worker
restores every array straight into its sharding on the target mesh.

    DIR/jaxserve_orbax.json    the ArchConfig
    DIR/params/                Orbax (tensorstore) arrays, the Flax param tree
    DIR/tokenizer.json, ...    the tokenizer and chat template
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxserve.models.arch_config import ArchConfig, RopeScaling

ARCH_FILE = "jaxserve_orbax.json"


def save_orbax(out_dir: str, arch: ArchConfig, params: dict[str, Any]) -> None:
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(out_dir, "params"), params, force=True)
    ckptr.wait_until_finished()
    with open(os.path.join(out_dir, ARCH_FILE), "w") as f:
        json.dump(dataclasses.asdict(arch), f, indent=2)


def read_orbax_arch(model_dir: str) -> ArchConfig:
    path = os.path.join(model_dir, ARCH_FILE)
    with open(path) as f:
        d = json.load(f)
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    for name in ("eos_token_id", "layer_types", "moe_layers"):  # JSON lists: tuples keep the config hashable
        if isinstance(d.get(name), list):
            d[name] = tuple(d[name])
    return ArchConfig(**d)


def restore_orbax(model_dir: str, dtype: Any, shardings: Any | None = None) -> dict[str, Any]:
    """Restore the param tree in `dtype`.

    With `shardings` (a tree of NamedSharding matching the params) every array is
    read directly into its shards on the mesh; without, into host NumPy arrays.
    """
    path = os.path.join(os.path.abspath(model_dir), "params")
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path).item_metadata.tree
    if shardings is None:
        cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        shardings = jax.tree.map(lambda _: cpu, meta)
        target = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, dtype, sharding=s), meta, shardings)
        return jax.tree.map(np.asarray, ckptr.restore(path, target))
    target = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, dtype, sharding=s), meta, shardings)
    return ckptr.restore(path, target)


def orbax_param_shapes(model_dir: str) -> dict[str, Any]:
    """Shapes of the stored params (a tree of ShapeDtypeStruct), without reading them."""
    path = os.path.join(os.path.abspath(model_dir), "params")
    meta = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta)
