"""The compute dtypes and precision modes a run may name (``--dtype``, ``--precision``): the one lists.

Torch-free, so the config and the command line name them without importing torch.
"""
from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes per element
DTYPES = tuple(DTYPE_BYTES)
#: ``--precision`` (``FinetuneConfig.precision``): ``exact`` trains in the dtype's arithmetic
#: (16-bit weights through fp32 masters); ``bf16-lean`` updates bf16 weights themselves, with
#: no master, rounding stochastically (``optim/lean.py``)
EXACT, BF16_LEAN = "exact", "bf16-lean"
PRECISIONS = (EXACT, BF16_LEAN)


def torch_dtype(name: str) -> Any:
    """``"bfloat16"`` -> ``torch.bfloat16`` (imports torch)."""
    import torch

    return getattr(torch, name)
