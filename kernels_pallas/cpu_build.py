"""Build and cache the C++ CPU kernels (XLA FFI handlers) with the system's compiler.

Each kernel is built on first use with `$CXX` (else g++) against jaxlib's FFI headers, into
`$KERNELS_PALLAS_CACHE` (default `~/.cache/kernels_pallas`), named by a hash of its sources,
the flags, the compiler and the jaxlib version, so an upgrade rebuilds and several processes
share one build (written to a temporary name, then renamed).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

# kernels_pallas/cpu_kernels.h and any other shared header live here.
INCLUDE_DIR = Path(__file__).parent
BUILD_TIMEOUT_S = 300
# The C++ runtime linked in statically: a process may already have loaded an older
# libstdc++ (a conda Python) than the one the system's g++ builds against.
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra",
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
        # jaxlib's FFI headers as system headers: their own warnings are not ours.
        cmd = [*cxx, *all_flags, "-isystem", jax.ffi.include_dir(), f"-I{INCLUDE_DIR}", str(source),
               "-o", str(tmp_out), *libs]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent build of the same key is identical
    return out


class FfiLibrary:
    """A C++ kernel library built on first use, its XLA FFI handlers registered for the CPU;
    or, when it cannot be (no compiler, a failed build, a CPU without what `supported` checks),
    the reason, so callers take their XLA path. Thread-safe: one build and one registration
    when several threads trace at once."""

    def __init__(self, name: str, source: Path, flags: Sequence[str], handlers: dict[str, str],
                 supported: str, what: str, fallback: str, requires: str = "AVX2/FMA") -> None:
        """`handlers`: FFI target name -> the library's handler symbol; `supported`: a C
        function of the library returning nonzero when this CPU has `requires` (what the
        kernel executes); `what` and `fallback` word the warning ("CPU {what}
        unavailable, {fallback}: why")."""
        self.name, self.source, self.flags = name, source, tuple(flags)
        self.handlers, self.supported = handlers, supported
        self.what, self.fallback, self.requires = what, fallback, requires
        self._lib: ctypes.CDLL | None = None
        self._reason: str | None = None
        self._tried = False
        self._lock = threading.Lock()

    def build(self) -> tuple[Path, bool]:
        """The library's path and whether it has its optional parts (subclasses: oneDNN)."""
        return build(self.name, self.source, self.flags, headers=[INCLUDE_DIR / "cpu_kernels.h"]), False

    def registered(self, lib: ctypes.CDLL, optional: bool) -> None:
        """Called once the required handlers are registered (subclasses: optional ones)."""

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, or None (then `unavailable_reason()` says why)."""
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    path, optional = self.build()
                    lib = ctypes.CDLL(str(path))
                    if not getattr(lib, self.supported)():
                        raise RuntimeError(f"this CPU lacks {self.requires}")
                    for target, symbol in self.handlers.items():
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                                    platform="cpu")
                    self.registered(lib, optional)
                    self._lib = lib
                except Exception as e:  # noqa: BLE001 - any failure means: the caller's XLA path
                    self._reason = str(e)
                    logger.warning("CPU %s unavailable, %s: %s", self.what, self.fallback, e)
            return self._lib

    def available(self) -> bool:
        """Whether the library is built and its handlers registered (builds it on first call)."""
        return self.load() is not None

    def unavailable_reason(self) -> str | None:
        return self._reason
