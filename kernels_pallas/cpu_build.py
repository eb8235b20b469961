"""Build and cache the C++ CPU kernels (XLA FFI handlers) with the system's compiler.

Each kernel is built on first use with `$CXX` (else g++) against jaxlib's FFI headers, into
`$KERNELS_PALLAS_CACHE` (default `~/.cache/kernels_pallas`), named by a hash of its sources,
the flags, the compiler and the jaxlib version, so an upgrade rebuilds and several processes
share one build (written to a temporary name, then renamed).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib

# kernels_pallas/cpu_kernels.h and any other shared header live here.
INCLUDE_DIR = Path(__file__).parent
BUILD_TIMEOUT_S = 300
# The C++ runtime linked in statically: a process may already have loaded an older
# libstdc++ (a conda Python) than the one the system's g++ builds against.
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w",
                "-static-libstdc++", "-static-libgcc")


def cache_dir() -> Path:
    """$KERNELS_PALLAS_CACHE, else ~/.cache/kernels_pallas, else a per-user temporary dir."""
    if "KERNELS_PALLAS_CACHE" in os.environ:
        return Path(os.environ["KERNELS_PALLAS_CACHE"]).expanduser()
    home = Path("~/.cache/kernels_pallas").expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:  # a read-only home
        return Path(tempfile.gettempdir()) / f"kernels_pallas-{os.getuid()}"


def compiler() -> list[str]:
    """The C++ compiler command: $CXX when set (e.g. "ccache g++"), else g++ or c++."""
    wanted = shlex.split(os.environ.get("CXX", ""))
    found = shutil.which(wanted[0]) if wanted else shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise RuntimeError(f"no C++ compiler {os.environ.get('CXX') or 'g++'!r} (set CXX or install g++)")
    return [found, *wanted[1:]]


def build(name: str, source: Path, flags: Sequence[str], libs: Sequence[str] = (),
          headers: Sequence[Path] = ()) -> Path:
    """The shared library built from `source` (cached; raises RuntimeError when the build
    fails). `headers` are hashed with the source; `libs` are linked (e.g. "-ldnnl")."""
    cxx = compiler()
    all_flags = (*COMMON_FLAGS, *flags)
    digest = hashlib.sha256(source.read_bytes())
    for h in headers:
        digest.update(h.read_bytes())
    digest.update(" ".join((*all_flags, *libs, *cxx)).encode() + jaxlib.__version__.encode())
    out = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [*cxx, *all_flags, f"-I{jax.ffi.include_dir()}", f"-I{INCLUDE_DIR}", str(source),
               "-o", str(tmp_out), *libs]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent build of the same key is identical
    return out
