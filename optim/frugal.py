"""FRUGAL (Zmushko et al., 2024): a state-full subspace with AdamW, signSGD on the rest.

For a matrix parameter (m, n) in a group with a ``density``, a random subset of
``k = ceil(density * n)`` columns is the state-full subspace: those columns get AdamW
(moments of shape (m, k)); all other columns get the state-free signSGD step
``-lr * free_lr_scale * sign(g)``. Every ``update_proj_gap`` steps the subset changes and
the moments (with their bias-correction count) restart, as in the paper. The column set
is never stored: it is regenerated from the ``seed`` in the state (``randperm`` of a
seeded generator), which advances at each refresh. Non-matrix parameters, and groups with
``density`` None, get full AdamW.

This is FRUGAL's column-block ("blockwise columns") variant; the paper's SVD/random
projection variants are GaLore-like and covered by :mod:`outcore.optim.galore`. Weight
decay is AdamW's decoupled decay on the whole matrix. No reference package exists on
PyPI, so the tests check the definition directly (an equivalent dense computation). The
step of a subspace matrix is :func:`outcore.kernels.frugal.frugal_update_` (one C++ pass on
the CPU).

State per subspace parameter: ``step`` and ``sub_step`` () float32, ``seed`` () int64,
``exp_avg`` / ``exp_avg_sq`` (m, k): 8 * density bytes per parameter.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import Tensor

from ..kernels.adamw8bit import adamw_step_ref, coefficients
from ..kernels.frugal import frugal_update_
from ._base import OutcoreOptimizer, StateSpec, check_hparams
from ._lowrank import check_rank, next_seed


class FRUGAL(OutcoreOptimizer):
    """FRUGAL with a random column subspace.

    Args:
        params: parameters or param-group dicts.
        lr, betas, eps, weight_decay: AdamW hyper-parameters.
        density: share of columns in the state-full subspace, in (0, 1]; None: full AdamW.
        update_proj_gap: steps between subspace changes.
        free_lr_scale: the signSGD step is ``lr * free_lr_scale``.
        seed: base seed; parameter i's first subspace uses ``seed + i``.

    Raises:
        ValueError: a hyper-parameter is out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, density: float | None = 0.25,
                 update_proj_gap: int = 200, free_lr_scale: float = 1.0, seed: int = 0) -> None:
        check_hparams(lr, betas, eps, weight_decay)
        check_rank("update_proj_gap", update_proj_gap)
        if density is not None and not 0.0 < density <= 1.0:
            raise ValueError(f"density={density!r} must be in (0, 1] (or None for full AdamW)")
        if not free_lr_scale >= 0.0:
            raise ValueError(f"free_lr_scale={free_lr_scale!r} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      density=density, update_proj_gap=update_proj_gap,
                                      free_lr_scale=free_lr_scale, seed=seed))

    @staticmethod
    def subspace_size(p: Tensor, group: dict[str, Any]) -> int | None:
        """Columns in ``p``'s state-full subspace, or None when ``p`` gets full AdamW."""
        if p.dim() != 2 or group.get("density") is None:
            return None
        return max(1, math.ceil(group["density"] * p.shape[1]))

    def state_spec(self, p: Tensor, group: dict[str, Any]) -> StateSpec:
        """See the module docstring."""
        k = self.subspace_size(p, group)
        scalar = torch.Size([])
        if k is None:
            return {"step": (scalar, torch.float32), "exp_avg": (p.shape, p.dtype),
                    "exp_avg_sq": (p.shape, p.dtype)}
        low = torch.Size([p.shape[0], k])
        return {"step": (scalar, torch.float32), "sub_step": (scalar, torch.float32),
                "seed": (scalar, torch.int64), "exp_avg": (low, p.dtype),
                "exp_avg_sq": (low, p.dtype)}

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """Zeros, and the first subspace seed ``group seed + parameter index``."""
        state = super().init_state(p, group)
        if "seed" in state:
            state["seed"].fill_(int(group["seed"]) + self.param_index(p))
        return state

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """FRUGAL step of each parameter, in place."""
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p, grad, s in zip(params, grads, states):
            step = int(s["step"].item())  # CPU scalar; on CUDA a sync, once per tensor
            s["step"].add_(1)
            if "seed" not in s:  # full AdamW
                c = coefficients(lr, beta1, beta2, group["eps"], wd, step + 1)
                new, m, v = adamw_step_ref(p, grad, s["exp_avg"], s["exp_avg_sq"], c)
                for t, value in ((p, new), (s["exp_avg"], m), (s["exp_avg_sq"], v)):
                    t.copy_(value)
                continue
            if step > 0 and step % group["update_proj_gap"] == 0:  # new subspace, fresh moments
                s["seed"].fill_(next_seed(int(s["seed"].item())))
                for name in ("exp_avg", "exp_avg_sq", "sub_step"):
                    s[name].zero_()
            cols = subspace_columns(p.shape[1], s["exp_avg"].shape[1], int(s["seed"].item()),
                                    p.device)
            s["sub_step"].add_(1)
            c = coefficients(lr, beta1, beta2, group["eps"], wd, float(s["sub_step"].item()))
            frugal_update_(p, grad, cols, s["exp_avg"], s["exp_avg_sq"], c, -lr * group["free_lr_scale"])


def subspace_columns(n: int, k: int, seed: int, device: torch.device) -> Tensor:
    """The ``k`` state-full columns out of ``n`` for ``seed`` (sorted, int64, on ``device``)."""
    gen = torch.Generator().manual_seed(int(seed))  # drawn on CPU: same set on every device
    return torch.randperm(n, generator=gen)[:k].sort().values.to(device)
