"""Compile-only devices: TPUs from libtpu's topologies, NVIDIA GPUs from XLA target specs.

`parse_target` reads a target name without importing JAX (a bad name fails at once, listing
what exists); `make_devices` then builds devices that the real compilers (Mosaic; Triton and
ptxas) compile for, on a machine that has neither (needs `pip install -e '.[preflight]'`):

    v5e:1x1, v6e:2x4, tpu7x:2x2x1, ...   libtpu's topology names (generation:chips)
    h100, h200                           XLA's GPU target specs, shipped in gpu_targets/
    path/to/gpu.txtpb                    any GpuTargetConfigProto
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from jaxserve.chips import CHIPS

# HBM per device (a chip, or one of its TensorCores where libtpu makes each a device:
# v4 and tpu7x). The compiler refuses programs a little under these (it keeps some back).
TPU_GENERATIONS: dict[str, int] = {
    g: CHIPS[g].hbm_bytes // CHIPS[g].devices_per_chip for g in ("v4", "v5e", "v5p", "v6e", "tpu7x")
}
# JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION: the share of a GPU its allocator takes.
GPU_MEM_FRACTION = 0.75
GPU_TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
GPU_TARGETS = tuple(sorted(f[:-6] for f in os.listdir(GPU_TARGETS_DIR) if f.endswith(".txtpb")))
_TOPOLOGY = re.compile(r"(?P<gen>[a-z0-9]+):(?P<dims>\d+(x\d+){1,2})")


@dataclasses.dataclass(frozen=True)
class Target:
    """A device kind to compile for, with its memory per device."""

    name: str  # as the user wrote it
    platform: str  # "tpu" or "cuda"
    memory_bytes: int  # what the engine may use per device (bytes_limit on a real one)
    num_chips: int  # TPU: chips in the topology; GPU: 0 (as many as the mesh needs)
    spec: str = ""  # GPU: the GpuTargetConfigProto text
    chip: str = ""  # its row in jaxserve/chips.py ("" for a target spec file)


def supported_targets() -> str:
    tpus = ", ".join(f"{g}:AxB" for g in TPU_GENERATIONS)
    return (f"TPU topologies as libtpu names them ({tpus}; e.g. v5e:1x1, v5e:2x2, v6e:2x4, "
            f"tpu7x:2x2x1), a GPU ({', '.join(GPU_TARGETS)}) or a GpuTargetConfigProto file")


def parse_target(name: str) -> Target:
    """The target `name` names, or ValueError listing what is supported (no JAX needed)."""
    m = _TOPOLOGY.fullmatch(name.strip().lower())
    if m and m["gen"] in TPU_GENERATIONS:
        chips = 1
        for d in m["dims"].split("x"):
            chips *= int(d)
        if chips < 1:
            raise ValueError(f"--target {name!r}: a topology needs at least one chip")
        return Target(name, "tpu", TPU_GENERATIONS[m["gen"]], chips, chip=m["gen"])
    path = os.path.join(GPU_TARGETS_DIR, f"{name.lower()}.txtpb")
    if not os.path.exists(path) and name.endswith(".txtpb") and os.path.exists(name):
        path = name
    if os.path.exists(path):
        spec = open(path).read()
        size = re.search(r"device_memory_size:\s*(\d+)", spec)
        if not size:
            raise ValueError(f"--target {name!r}: the GPU target spec has no device_memory_size")
        # What a real GPU's runtime would give the engine: JAX's allocator takes this
        # fraction of the device (device.memory_stats()["bytes_limit"] there).
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEM_FRACTION))
        stem = os.path.basename(path)[: -len(".txtpb")]
        return Target(name, "cuda", int(int(size.group(1)) * fraction), 0, spec,
                      chip=stem if path.startswith(GPU_TARGETS_DIR) else "")
    raise ValueError(f"unknown --target {name!r}; supported: {supported_targets()}")


def make_devices(target: Target, count: int) -> list[Any]:
    """`count` compile-only devices of `target` (ValueError when the topology has fewer)."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    # libtpu takes a machine-wide lock on load; compile-only processes may share the machine.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - jax is a dependency
        raise ValueError(f"JAX cannot make compile-only devices: {e}") from None
    try:
        if target.platform == "tpu":
            try:
                topo = topologies.get_topology_desc(target.name, "tpu")
            except Exception:  # noqa: BLE001 - single-chip names need explicit host bounds
                topo = topologies.get_topology_desc(target.name, "tpu",
                                                    chips_per_host_bounds=(1, 1, 1))
        else:
            topo = topologies.get_topology_desc(target.name, "cuda", target_config=target.spec,
                                                topology=f"1x1x{count}")
    except Exception as e:  # noqa: BLE001 - a missing plugin reads as one of many errors
        extra = "libtpu" if target.platform == "tpu" else "the CUDA plugin"
        raise ValueError(f"cannot make compile-only {target.name} devices ({extra} needed: "
                         f"pip install -e '.[preflight]'): {type(e).__name__}: {e}") from None
    devices = list(topo.devices)
    if len(devices) < count:
        raise ValueError(f"--target {target.name} has {len(devices)} devices, but the engine "
                         f"flags need {count} (tensor x pipeline parallel)")
    return devices[:count]
