"""APOLLO and APOLLO-Mini (Zhu et al., 2024): SGD-like memory, AdamW-level performance.

For a matrix parameter (m, n) in a group with a ``rank``, the gradient is projected with
a *random* Gaussian matrix (r, n) or (m, r) scaled by 1/sqrt(r); Adam runs on the
projected gradient only to estimate a learning-rate scaling — per channel
(``scale_type="channel"``: row or column norms of the Adam update over the projected
gradient) or per tensor (``"tensor"``) — and the *raw* gradient, scaled by it, is the
update (times ``sqrt(scale)``). A norm-growth limiter (from Fira) caps the update norm's
growth at 1.01x per step. APOLLO-Mini is rank 1, tensor-wise scaling, ``scale=128``.

The projection matrix is never stored: the state keeps its int64 ``seed`` and the matrix
is regenerated every step; at a refresh (every ``update_proj_gap`` steps) the seed
advances with APOLLO's ``next_seed``. The first seed of a parameter is its 1-based index
among all parameters of the optimizer, as in the reference.

State per projected parameter: ``step`` () float32, ``seed`` () int64, ``scaled_grad_norm``
() float32 (the limiter's memory), ``exp_avg`` / ``exp_avg_sq`` (m, r) or (r, n). For
APOLLO-Mini that is 2 * max(m, n) floats for an m x n matrix: far below one byte per
parameter. Non-projected parameters get plain Adam.

Numerics follow ``apollo_torch.APOLLOAdamW`` (``proj="random"``, ``proj_type="std"``),
including its weight decay order (``p -= lr * wd * p`` after the update), up to rounding
(tested: relative difference <= 1e-5 after 10 steps): the scaled raw gradient is applied in
one ``addcmul_`` with its norm taken from the gradient's (:func:`_raw_grad_scale`).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import Tensor

from ._base import OutcoreOptimizer, StateSpec, check_hparams
from ._lowrank import (adam_moments, check_rank, decay_after, galore_defaults, galore_step_size,
                       low_rank_shape, next_seed, projects, right_side, stable_randn)

SCALE_TYPES = ("channel", "tensor")


class APOLLO(OutcoreOptimizer):
    """APOLLO-AdamW (``rank`` 256, channel-wise scaling by default).

    Args:
        params: parameters or param-group dicts (a group's ``rank`` None: plain Adam).
        lr, betas, eps, weight_decay: Adam hyper-parameters (``eps`` 1e-6 as APOLLO).
        rank: projection rank.
        update_proj_gap: steps between projection refreshes (a new seed).
        scale: the update is multiplied by ``sqrt(scale)``.
        scale_type: "channel" or "tensor".
        norm_growth_limit: apply the norm-growth limiter (APOLLO's default).

    Raises:
        ValueError: a hyper-parameter is out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, rank: int | None = 256, update_proj_gap: int = 200,
                 scale: float = 1.0, scale_type: str = "channel",
                 norm_growth_limit: bool = True) -> None:
        check_hparams(lr, betas, eps, weight_decay)
        check_rank("rank", rank)
        check_rank("update_proj_gap", update_proj_gap)
        if scale_type not in SCALE_TYPES:
            raise ValueError(f"scale_type={scale_type!r} is not one of {SCALE_TYPES}")
        if not scale > 0:
            raise ValueError(f"scale={scale!r} must be > 0")
        super().__init__(params, galore_defaults(
            lr, betas, eps, weight_decay, rank=rank, update_proj_gap=update_proj_gap,
            scale=scale, scale_type=scale_type, norm_growth_limit=norm_growth_limit))

    def state_spec(self, p: Tensor, group: dict[str, Any]) -> StateSpec:
        """See the module docstring."""
        spec = {"step": (torch.Size([]), torch.float32)}
        if not projects(p, group):
            return {**spec, "exp_avg": (p.shape, p.dtype), "exp_avg_sq": (p.shape, p.dtype)}
        low = low_rank_shape(p.shape, group["rank"])
        return {**spec, "seed": (torch.Size([]), torch.int64),
                "scaled_grad_norm": (torch.Size([]), torch.float32),
                "exp_avg": (low, p.dtype), "exp_avg_sq": (low, p.dtype)}

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """Zeros, and the first projection seed: ``p``'s 1-based index in the optimizer."""
        state = super().init_state(p, group)
        if "seed" in state:
            state["seed"].fill_(self.param_index(p) + 1)
        return state

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """APOLLO step of each parameter, in place."""
        beta1, beta2 = group["betas"]
        for p, grad, s in zip(params, grads, states):
            step = int(s["step"].item())  # CPU scalars; on CUDA a sync, once per tensor
            low = grad
            if "seed" in s:
                if step > 0 and step % group["update_proj_gap"] == 0:
                    s["seed"].fill_(next_seed(int(s["seed"].item())))
                low = _project(grad, int(s["seed"].item()), s["exp_avg"].shape)
            adam_moments(s["exp_avg"], s["exp_avg_sq"], low, beta1, beta2)
            s["step"].add_(1)
            denom = s["exp_avg_sq"].sqrt().add_(group["eps"])
            step_size = galore_step_size(group["lr"], beta1, beta2, step + 1)
            update = s["exp_avg"] / denom
            if "seed" in s:  # the raw gradient, scaled: one pass, no full-size temporary
                p.addcmul_(grad, _raw_grad_scale(grad, low, update, s, step == 0, group), value=-step_size)
            else:
                p.add_(update, alpha=-step_size)
            decay_after(p, group["lr"], group["weight_decay"])


class APOLLOMini(APOLLO):
    """APOLLO-Mini: rank 1, tensor-wise scaling, ``scale`` 128 (same arguments as APOLLO)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, rank: int | None = 1, update_proj_gap: int = 200,
                 scale: float = 128.0, scale_type: str = "tensor",
                 norm_growth_limit: bool = True) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, rank, update_proj_gap, scale,
                         scale_type, norm_growth_limit)


def _project(grad: Tensor, seed: int, low: torch.Size) -> Tensor:
    """Random projection of ``grad`` (m, n) to ``low`` ((m, r) or (r, n)), regenerated from ``seed``."""
    m, n = grad.shape
    if right_side(grad.shape):
        r = low[1]
        proj = stable_randn((r, n), seed, grad.device, grad.dtype) / math.sqrt(r)
        return grad @ proj.t()
    r = low[0]
    proj = stable_randn((m, r), seed, grad.device, grad.dtype) / math.sqrt(r)
    return proj.t() @ grad


def _raw_grad_scale(grad: Tensor, low: Tensor, update: Tensor, s: dict[str, Tensor],
                    first: bool, group: dict[str, Any]) -> Tensor:
    """What the raw gradient is multiplied by: APOLLO's scaling factor (per tensor (), per row
    (m, 1) or per column (n,)), over the norm-growth limiter, times sqrt(scale).

    The limiter needs the norm of ``grad * factor``; it comes from the gradient's norms
    (per tensor, row or column, one reduction pass) times the factor, so that the scaled
    gradient is never materialized: the reference's multiply, norm, divide and multiply are
    four passes over a full-size temporary (and the update a fifth), here it is one
    ``addcmul_``. Equal to apollo_torch's values up to rounding (the tests' tolerance).
    """
    if group["scale_type"] == "channel":
        dim = 0 if grad.shape[0] < grad.shape[1] else 1  # the low-rank dimension
        factor = torch.norm(update, dim=dim) / (torch.norm(low, dim=dim) + 1e-8)
        norm = torch.norm(factor * torch.norm(grad, dim=dim)) if group["norm_growth_limit"] else None
        if dim == 1:
            factor = factor.unsqueeze(1)
    else:
        factor = torch.norm(update) / (torch.norm(low) + 1e-8)
        norm = factor * torch.norm(grad) if group["norm_growth_limit"] else None
    if norm is not None:
        if first:
            s["scaled_grad_norm"].copy_(norm)
        else:
            limiter = torch.clamp_min(norm / (s["scaled_grad_norm"] + 1e-8), 1.01) / 1.01
            factor = factor / limiter
            s["scaled_grad_norm"].copy_(norm / limiter)
    return factor * math.sqrt(group["scale"])
