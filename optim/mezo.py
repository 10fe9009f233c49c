"""MeZO-SGD: zeroth-order fine-tuning with in-place perturbation (Malladi et al., 2023).

A ``torch.optim.Optimizer`` whose ``step(closure)`` needs only forward passes::

    opt = MeZO.from_model(model, lr=1e-6, eps=1e-3)
    for batch in data:
        loss = opt.step(lambda: model(**batch).loss)

For each of ``n_samples`` seeds it perturbs every trainable parameter in place by
``+eps z``, evaluates the closure, moves to ``-eps z``, evaluates again and
restores with ``+eps z`` — memory stays at inference level (no gradients, no
activations kept, no optimizer state). z is regenerated from the seed by
:func:`outcore.kernels.zo_perturb.zo_perturb_`, never stored.

fp32 note: ``w + eps z - 2 eps z + eps z`` is not exactly ``w`` after rounding.
The drift is deterministic, so :func:`outcore.optim.zo_replay.replay` re-applies
the same three perturbations (log schedule ``"inplace"``) and reproduces the
weights bit-for-bit. The block schedule in :mod:`outcore.offload.zo.engine`
instead perturbs from a clean copy of one block and restores exactly
(schedule ``"exact"``); that is the path the recipe, streaming and distributed
ZO use.

Only parameters with ``requires_grad`` are perturbed and updated: on a peft LoRA
model that is ZO on the adapters only.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..errors import ConfigError
from ..kernels.zo_perturb import noise_backend
from .zo_core import (StepRecord, ZOHyper, ZOState, apply_update_, mask_for, needs_thresholds,
                      perturb_, projected_grads, sample_seeds, threshold_of)

SCHEDULE_INPLACE = "inplace"


class MeZO(torch.optim.Optimizer):
    """Zeroth-order SGD (SPSA) with n samples, weight decay and windowed ZO momentum.

    Args:
        params: parameters, or ``(name, parameter)`` pairs (names make the run log
            replayable onto a state dict), or param-group dicts.
        lr: learning rate (change it per step through ``param_groups[0]["lr"]`` or
            any ``torch.optim.lr_scheduler``; every group must share it).
        eps: perturbation scale.
        n_samples: perturbations per step.
        weight_decay: decoupled weight decay.
        momentum: windowed ZO momentum factor (0 disables it).
        momentum_window: steps in the momentum window (0 = auto).
        seed: run seed; step ``t``'s sample seeds are ``sample_seeds(seed, t, n)``.

    Raises:
        ConfigError: a bad hyper-parameter, or no trainable parameter.
    """

    sparsity: float = 0.0

    def __init__(self, params: Iterable[Any], lr: float = 1e-6, eps: float = 1e-3, n_samples: int = 1,
                 weight_decay: float = 0.0, momentum: float = 0.0, momentum_window: int = 0,
                 seed: int = 0, sparsity: float = 0.0, mask_every: int = 50) -> None:
        if not (lr > 0):
            raise ConfigError(f"lr={lr!r} must be > 0")
        params = list(params)
        self.param_names: list[str] | None = None
        if params and isinstance(params[0], tuple):
            self.param_names = [n for n, p in params if p.requires_grad]
            params = [p for _, p in params]
        self.hyper = ZOHyper(eps=eps, n_samples=n_samples, weight_decay=weight_decay, momentum=momentum,
                             momentum_window=momentum_window, sparsity=sparsity, mask_every=mask_every)
        super().__init__(params, {"lr": lr})
        self.seed = int(seed)
        # z's backend: the parameters' device's own (kernels/zo_perturb.py); a resume sets the log's
        self.zo_state = ZOState(self.hyper, backend=noise_backend(self.trainable()[0].device) if self.trainable()
                                else None)
        self.log: list[StepRecord] = []
        if not self.trainable():
            raise ConfigError("MeZO got no parameter with requires_grad=True; unfreeze what should train")

    @classmethod
    def from_model(cls, model: torch.nn.Module, **kwargs: Any) -> "MeZO":
        """An optimizer over ``model``'s trainable parameters, with their names."""
        return cls([(n, p) for n, p in model.named_parameters() if p.requires_grad], **kwargs)

    def trainable(self) -> list[torch.Tensor]:
        """The perturbed parameters in index order (the index selects z)."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _lr(self) -> float:
        lrs = {float(g["lr"]) for g in self.param_groups}
        if len(lrs) != 1:
            raise ConfigError(f"MeZO needs one lr for all param groups, got {sorted(lrs)}")
        return lrs.pop()

    def header(self) -> dict[str, Any]:
        """The run-log header describing this optimizer (see :mod:`outcore.optim.zo_replay`)."""
        params = self.trainable()
        names = self.param_names or [f"param{i}" for i in range(len(params))]
        return {"schedule": SCHEDULE_INPLACE, "seed": self.seed, "hyper": self.hyper.to_dict(),
                "params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                           for n, p in zip(names, params)],
                "backend": self.zo_state.backend}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any]) -> float:  # type: ignore[override]
        """One ZO step: ``2 * n_samples`` closure calls, then the update.

        Args:
            closure: evaluates the model and returns the loss (tensor or float). It
                is called under ``torch.no_grad()``; it must not call backward.

        Returns:
            The mean of the +/- losses (a host sync: ``.item()`` per closure call).
        """
        if closure is None:
            raise ConfigError("MeZO.step needs a closure that returns the loss")
        params = self.trainable()
        hyper, state = self.hyper, self.zo_state
        t = len(self.log) + 1
        thresholds = None
        if needs_thresholds(hyper, t):
            thresholds = [threshold_of(p, hyper.sparsity) for p in params]
            state.thresholds = thresholds
        seeds = sample_seeds(self.seed, t, hyper.n_samples)
        plus, minus = [], []
        for s in seeds:
            masks = [mask_for(p, state, j) for j, p in enumerate(params)]  # held for this sample only
            for j, p in enumerate(params):
                perturb_(p, s, j, hyper.eps, masks[j], backend=state.backend)
            plus.append(float(closure()))  # host sync: the scalar decides the update
            for j, p in enumerate(params):
                perturb_(p, s, j, -2.0 * hyper.eps, masks[j], backend=state.backend)
            minus.append(float(closure()))
            for j, p in enumerate(params):
                perturb_(p, s, j, hyper.eps, masks[j], backend=state.backend)
            del masks
        rec = StepRecord(step=t, seeds=seeds, grads=projected_grads(plus, minus, hyper.eps), lr=self._lr(),
                         loss=(sum(plus) + sum(minus)) / (2 * len(seeds)), thresholds=thresholds)
        state.push(rec)
        for j, p in enumerate(params):
            apply_update_(p, j, state)
        self.log.append(rec)
        return rec.loss
