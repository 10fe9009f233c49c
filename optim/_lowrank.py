"""Pieces shared by the low-rank / subspace optimizers (GaLore, APOLLO, FRUGAL).

* seeded randomness that is regenerated, never stored (APOLLO's ``stable_randn`` /
  ``next_seed``, reproduced exactly so the reference and ours draw the same numbers),
* the projection side rule of GaLore / APOLLO ("std": project the smaller dimension),
* the Adam moment update in the form GaLore and APOLLO use (``eps`` outside the sqrt,
  bias correction folded into the step size).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

_INT64_MAX = torch.iinfo(torch.int64).max


def next_seed(seed: int, adv: int = 0xF) -> int:
    """The seed after ``seed`` (APOLLO's rule: the last of ``adv`` draws of a generator).

    Args:
        seed: current seed.
        adv: number of draws.

    Returns:
        A new seed in [0, 2**63 - 1).
    """
    gen = torch.Generator().manual_seed(int(seed))
    return int(torch.randint(0, _INT64_MAX, (adv,), generator=gen).tolist()[-1])


def stable_randn(shape: tuple[int, ...], seed: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """A normal tensor that depends only on (shape, seed, device type).

    Args:
        shape: result shape.
        seed: generator seed.
        device: where to draw (a CUDA draw differs from a CPU draw of the same seed).
        dtype: result dtype.

    Returns:
        Tensor of ``shape``.
    """
    gen = torch.Generator(device=device).manual_seed(int(seed))
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


def projects(p: Tensor, group: dict[str, Any]) -> bool:
    """Whether ``p`` gets a low-rank projection: a matrix in a group with a ``rank``."""
    return p.dim() == 2 and group.get("rank") is not None


def right_side(shape: torch.Size) -> bool:
    """GaLore/APOLLO "std" rule: project from the right (columns) when rows >= columns."""
    return shape[0] >= shape[1]


def low_rank_shape(shape: torch.Size, rank: int) -> torch.Size:
    """Shape of a projected gradient of a (m, n) matrix: (m, r) or (r, n), r <= min(m, n)."""
    m, n = shape
    r = min(int(rank), m, n)
    return torch.Size([m, r]) if right_side(shape) else torch.Size([r, n])


def adam_moments(exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, beta1: float,
                 beta2: float) -> None:
    """``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` in place (GaLore's op order)."""
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


def galore_step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """``lr * sqrt(1 - b2^t) / (1 - b1^t)`` (bias correction folded into the step size)."""
    return lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)


def galore_defaults(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                    **extra: Any) -> dict[str, Any]:
    """The defaults dict of a GaLore-style optimizer."""
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **extra)


def decay_after(p: Tensor, lr: float, weight_decay: float) -> None:
    """GaLore/APOLLO's weight decay: ``p += -lr * wd * p`` applied after the step."""
    if weight_decay > 0.0:
        p.add_(p, alpha=-lr * weight_decay)


def check_rank(name: str, value: Any, minimum: int = 1) -> None:
    """Raise ValueError unless ``value`` is None or an int >= ``minimum``."""
    if value is not None and (not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum} (or None)")
