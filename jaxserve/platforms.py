"""Which JAX platform to start, decided before JAX's first use of a device.

With the preflight extra installed (libtpu and the CUDA plugin beside the CPU jaxlib), JAX on a
machine with neither device probes both at start-up: seconds of waiting and a page of errors
before it settles on the CPU. A machine without accelerator device files can only run on the
CPU, so there jaxserve asks JAX for it directly (JAX's own config: the process environment, and
so any child process, is left as it was); anywhere else, and whenever JAX_PLATFORMS is set, JAX
chooses as usual.
"""

from __future__ import annotations

import glob
import os

# Device files of the accelerators JAX drives: TPU VMs (accel, vfio), NVIDIA, AMD (kfd).
ACCELERATOR_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def accelerator_attached() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_FILES)


def select_jax_platforms(cpu_only: bool = False) -> None:
    """Start only JAX's CPU backend when JAX_PLATFORMS is unset and either `cpu_only` (the
    preflight: its devices are compile-only) or no accelerator is attached. Call before
    anything touches a device; once JAX's backends are up this changes nothing."""
    if "JAX_PLATFORMS" in os.environ or not (cpu_only or not accelerator_attached()):
        return
    import jax

    jax.config.update("jax_platforms", "cpu")
