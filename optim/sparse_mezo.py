"""Sparse MeZO: perturb and update only the small-magnitude entries (Liu et al., 2024).

Sparse MeZO observes that ZO noise hurts most on large weights, and perturbs
only the entries with ``|w| <= threshold`` — the ``1 - sparsity`` smallest per
tensor. The mask is never stored: each parameter keeps one float (its
threshold, recomputed every ``mask_every`` steps and written to the run log),
and ``mask = |w| <= threshold`` is regenerated from the weights right before
each use and dropped at once (see :mod:`outcore.optim.zo_core`). In the
in-place optimizer path the masks of one sample live for that sample's three
perturbations (one byte per parameter, transient); the block schedule in
:mod:`outcore.offload.zo.engine` holds them for one block only.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..errors import ConfigError
from .mezo import MeZO


class SparseMeZO(MeZO):
    """MeZO-SGD restricted to the small-magnitude entries of each parameter.

    Args:
        params: as for :class:`MeZO`.
        sparsity: share of entries left out (the largest ``|w|``), in (0, 1); 0.75 in the paper.
        mask_every: steps between threshold recomputations.
        **kwargs: the other :class:`MeZO` options (lr, eps, n_samples, weight_decay,
            momentum, momentum_window, seed).

    Raises:
        ConfigError: ``sparsity`` outside (0, 1) or a bad MeZO option.
    """

    def __init__(self, params: Iterable[Any], sparsity: float = 0.75, mask_every: int = 50,
                 **kwargs: Any) -> None:
        if not 0.0 < sparsity < 1.0:
            raise ConfigError(f"sparsity={sparsity!r} must be in (0, 1) for Sparse MeZO (0.75 is typical)")
        super().__init__(params, sparsity=sparsity, mask_every=mask_every, **kwargs)
