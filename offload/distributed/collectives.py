"""Collectives over the default process group that know nothing of units: the ones every rank calls.

``flat_collectives`` picks torch's names for the reduce-scatter and all-gather of one flat
tensor per rank; ``global_norm`` sums a norm's squares over the ranks. What a unit's shard
sends and receives through them is the engine's (``offload/engine/sharding.py``).
"""
from __future__ import annotations

from typing import Any

import torch


def flat_collectives() -> tuple[Any, Any]:
    """``(reduce_scatter, all_gather)`` of ``torch.distributed`` over one flat tensor per rank.

    The same two collectives go by two names: torch 2.11 has only ``reduce_scatter_tensor`` /
    ``all_gather_into_tensor``; torch 2.13 adds ``reduce_scatter_single`` / ``all_gather_single``
    and deprecates the old names with a FutureWarning (a line on every rank's stderr). So the
    newer name where it exists (a lookup of the function itself, not of a version number).
    """
    import torch.distributed as dist

    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
            getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)


def global_norm(local: torch.Tensor) -> torch.Tensor:
    """The 2-norm of every rank's gradients from this rank's (``local``, fp32): the square root
    of the squares summed over the ranks."""
    import torch.distributed as dist

    squared = (local.float() * local.float()).reshape(1)
    dist.all_reduce(squared)
    return squared.sqrt().reshape(())
