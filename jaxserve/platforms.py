"""Which JAX platform to start, decided before JAX loads (JAX-free).

With the preflight extra installed (libtpu and the CUDA plugin beside the CPU jaxlib), JAX on a
machine with neither device probes both at start-up: seconds of waiting and a page of errors
before it settles on the CPU. A machine without accelerator device files can only run on the
CPU, so there jaxserve asks for it directly; anywhere else, and whenever JAX_PLATFORMS is set,
JAX chooses as usual.
"""

from __future__ import annotations

import glob
import os

# Device files of the accelerators JAX drives: TPU VMs (accel, vfio), NVIDIA, AMD (kfd).
ACCELERATOR_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def select_jax_platforms() -> str | None:
    """Set JAX_PLATFORMS=cpu when it is unset and no accelerator is attached; returns what
    JAX_PLATFORMS is now (None: JAX decides)."""
    if "JAX_PLATFORMS" not in os.environ and not any(
            glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_FILES):
        os.environ["JAX_PLATFORMS"] = "cpu"
    return os.environ.get("JAX_PLATFORMS")
