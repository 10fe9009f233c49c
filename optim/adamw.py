"""fp32 AdamW on the outcore contract, bit-identical to ``torch.optim.AdamW(fused=True)``.

The in-memory baseline trains with torch's fused AdamW; the out-of-core engine calls
:meth:`AdamW.update` block by block on state fetched from its tiered store. Both end in
the same kernel, ``torch._fused_adamw_`` (CPU and CUDA), called the same way (step
counts incremented first, then the fused update), so the two agree bit for bit.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from ._base import OutcoreOptimizer, StateSpec, check_hparams


class AdamW(OutcoreOptimizer):
    """AdamW with decoupled weight decay; state ``step`` (float32 scalar), ``exp_avg``,
    ``exp_avg_sq`` (param-shaped, param dtype).

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        betas: (beta1, beta2).
        eps: added to the denominator.
        weight_decay: decoupled weight decay (``p *= 1 - lr * wd`` each step).

    Raises:
        ValueError: a hyper-parameter is out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        check_hparams(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def state_spec(self, p: Tensor, group: dict[str, Any]) -> StateSpec:
        """``step`` () float32, ``exp_avg`` and ``exp_avg_sq`` shaped and typed like ``p``."""
        return {"step": (torch.Size([]), torch.float32),
                "exp_avg": (p.shape, p.dtype),
                "exp_avg_sq": (p.shape, p.dtype)}

    def elementwise_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, int]:
        """Element-wise: the moments line up with ``p``; one step count per tensor."""
        return {"step": 0, "exp_avg": 1, "exp_avg_sq": 1}

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """One fused AdamW step of ``params`` (same call as torch's fused AdamW)."""
        beta1, beta2 = group["betas"]
        buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):  # the fused kernel wants one device and dtype per call
            buckets.setdefault((p.device, p.dtype), []).append(i)
        for idx in buckets.values():
            steps = [states[i]["step"] for i in idx]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_([params[i] for i in idx], [grads[i] for i in idx],
                                [states[i]["exp_avg"] for i in idx],
                                [states[i]["exp_avg_sq"] for i in idx], [], steps,
                                lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"],
                                amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
