"""The device mesh: axes `data`, `stage` (pipeline) and `model` (tensor parallel).

Everything runs on a mesh from the first day, even a mesh of one device, so
single-device code and sharded code are the same code.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import ParallelConfig

MESH_AXES = ("data", "stage", "model")


def make_mesh(parallel: ParallelConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A mesh for one engine core: `stage x model` devices (data ranks are separate engines)."""
    devices = list(devices if devices is not None else jax.devices())
    need = parallel.pipeline_parallel_size * parallel.tensor_parallel_size
    # A data-parallel engine process takes its rank's slice when it sees every rank's
    # devices (on GPUs the launcher narrows CUDA_VISIBLE_DEVICES instead: select_rank_devices).
    rank, size = parallel.data_parallel_rank, parallel.data_parallel_size
    if size > 1 and len(devices) >= size * need:
        devices = devices[rank * need : (rank + 1) * need]
    if len(devices) < need:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {need} devices, "
            f"but only {len(devices)} are visible"
        )
    grid = np.array(devices[:need]).reshape(1, parallel.pipeline_parallel_size, parallel.tensor_parallel_size)
    return Mesh(grid, MESH_AXES)
