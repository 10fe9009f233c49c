"""The compute dtypes a run may name (``--dtype``, ``FinetuneConfig.dtype``): the one list.

Torch-free, so the config and the command line name them without importing torch.
"""
from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes per element
DTYPES = tuple(DTYPE_BYTES)


def torch_dtype(name: str) -> Any:
    """``"bfloat16"`` -> ``torch.bfloat16`` (imports torch)."""
    import torch

    return getattr(torch, name)
