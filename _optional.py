"""Optional dependencies, probed lazily (docs/architecture.md §13).

Nothing here imports an optional package at outcore import time: each check
uses ``importlib.util.find_spec`` (cheap, no import) and caches the answer.
"""
from __future__ import annotations

import functools
import importlib.util
import os


@functools.lru_cache(maxsize=None)
def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def is_triton_available() -> bool:
    """True when the ``triton`` package is installed (it may still need a GPU or TRITON_INTERPRET=1)."""
    return _has("triton")


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
