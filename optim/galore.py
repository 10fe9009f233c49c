"""GaLore: gradient low-rank projection (Zhao et al., 2024), on the outcore contract.

For a matrix parameter (m, n) in a group with a ``rank``, the gradient is projected onto
its top-``rank`` singular vectors (from the right when m >= n, else from the left), Adam
runs in that low-rank space, and the normalized update is projected back and scaled by
``scale``. The projection is refreshed by an SVD of the current gradient every
``update_proj_gap`` steps (step 0 included). Other parameters get plain Adam.

State per projected parameter: ``step`` () float32, ``exp_avg`` / ``exp_avg_sq`` (m, r) or
(r, n), ``proj`` — the projection (r, n) or (m, r) stored *transposed* (n, r) or (r, m).
It must be stored (an SVD cannot be regenerated from a seed), but it is r/m of the
parameter's size. Transposed because LAPACK returns singular vectors column-major and the
reference multiplies with those views: the same memory layout gives the same BLAS
summation order, hence the same bits.

Numerics follow ``galore_torch.GaLoreAdamW`` op for op (tested: equal after 10 steps):
``eps`` outside the sqrt, bias correction folded into the step size, and weight decay
``p -= lr * wd * p`` applied *after* the update (the reference's order).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from ._base import OutcoreOptimizer, StateSpec, check_hparams
from ._lowrank import (adam_moments, check_rank, decay_after, galore_defaults, galore_step_size,
                       low_rank_shape, projects, right_side)


class GaLore(OutcoreOptimizer):
    """GaLore-AdamW.

    Args:
        params: parameters or param-group dicts; a group's ``rank`` (None: no projection)
            may differ per group, as in the reference.
        lr, betas, eps, weight_decay: Adam hyper-parameters (``eps`` default 1e-6 as GaLore).
        rank: projection rank for matrices (None disables projection for the group).
        update_proj_gap: steps between SVD refreshes.
        scale: multiplies the projected-back update.

    Raises:
        ValueError: a hyper-parameter is out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, rank: int | None = 128, update_proj_gap: int = 200,
                 scale: float = 0.25) -> None:
        check_hparams(lr, betas, eps, weight_decay)
        check_rank("rank", rank)
        check_rank("update_proj_gap", update_proj_gap)
        super().__init__(params, galore_defaults(lr, betas, eps, weight_decay, rank=rank,
                                                 update_proj_gap=update_proj_gap, scale=scale))

    def state_spec(self, p: Tensor, group: dict[str, Any]) -> StateSpec:
        """See the module docstring."""
        spec = {"step": (torch.Size([]), torch.float32)}
        if not projects(p, group):
            return {**spec, "exp_avg": (p.shape, p.dtype), "exp_avg_sq": (p.shape, p.dtype)}
        low = low_rank_shape(p.shape, group["rank"])
        proj = (torch.Size([p.shape[1], low[1]]) if right_side(p.shape)  # stored transposed
                else torch.Size([low[0], p.shape[0]]))
        return {**spec, "exp_avg": (low, p.dtype), "exp_avg_sq": (low, p.dtype),
                "proj": (proj, p.dtype)}

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """GaLore-Adam step of each parameter, in place."""
        beta1, beta2 = group["betas"]
        for p, grad, s in zip(params, grads, states):
            step = int(s["step"].item())  # CPU scalar; on CUDA a sync, once per tensor
            proj = s["proj"].t() if "proj" in s else None  # (r, n) or (m, r), column-major
            right = proj is not None and right_side(p.shape)
            if proj is not None:
                if step % group["update_proj_gap"] == 0:
                    proj.copy_(_svd_projection(grad, proj.shape, right))
                grad = grad @ proj.t() if right else proj.t() @ grad
            adam_moments(s["exp_avg"], s["exp_avg_sq"], grad, beta1, beta2)
            s["step"].add_(1)
            denom = s["exp_avg_sq"].sqrt().add_(group["eps"])
            step_size = galore_step_size(group["lr"], beta1, beta2, step + 1)
            norm_grad = s["exp_avg"] / denom
            if proj is not None:
                norm_grad = (norm_grad @ proj if right else proj @ norm_grad) * group["scale"]
            p.add_(norm_grad, alpha=-step_size)
            decay_after(p, group["lr"], group["weight_decay"])


def _svd_projection(grad: Tensor, shape: torch.Size, right: bool) -> Tensor:
    """Top singular vectors of ``grad`` (m, n): Vh[:r] (r, n) if ``right`` else U[:, :r] (m, r)."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    out = vh[: shape[0], :] if right else u[:, : shape[1]]
    return out.to(grad.dtype)
