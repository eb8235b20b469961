"""Ragged paged-attention variants, one file each; importing this package registers them all.

Files starting with "_" are helpers, not variants. A variant whose import fails (say a jaxlib
without Triton) is skipped and `get_backend` reports the error, so the CPU path keeps working.
"""

from __future__ import annotations

import importlib
import pkgutil

from kernels_pallas.registry import record_import_error

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda i: (i.name != "reference", i.name)):
    if _info.name.startswith("_"):
        continue
    try:
        importlib.import_module(f"{__name__}.{_info.name}")
    except ImportError as _error:  # NOTE: only ImportError; a bug in a variant must be loud
        record_import_error(_info.name, _error)
