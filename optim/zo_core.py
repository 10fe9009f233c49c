"""The zeroth-order update rule shared by every ZO path (optimizer, stream, replay, distributed).

One step ``t`` of MeZO-SGD (SPSA) with ``n`` perturbation samples:

* sample ``i`` has a seed ``s_ti`` (:func:`sample_seeds`); parameter ``j`` is
  perturbed with ``z = z(zo_seed(s_ti, j))`` — regenerated, never stored;
* the projected gradient is ``g_ti = (L(w + eps z) - L(w - eps z)) / (2 eps)``;
* the update (:func:`apply_update_`) is, in this order, per parameter::

      w *= 1 - lr_t * weight_decay                       (if weight_decay)
      for k in 0 .. window-1, for i in samples of step t-k:
          w += (-lr_t * momentum**k * g_(t-k)i / n) * z_(t-k)i * mask

  ZO momentum is the *windowed* heavy-ball sum ``sum_k momentum**k * ghat_(t-k)``:
  it is regenerated from the last ``window`` (seed, scalar) records instead of
  held in a dense buffer, so ZO keeps no optimizer state and stays replayable.
* Sparse MeZO: ``mask = |w| <= threshold_j`` (the small-magnitude entries),
  computed from the weights just before each use and dropped at once; the
  per-tensor thresholds are recomputed every ``mask_every`` steps as the
  ``(1 - sparsity)`` quantile of ``|w_j|`` and logged.

Every path calls these functions in the same order per element, so their fp32
results are bit-identical. :class:`ZORule` bundles them for the block schedule.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from ..kernels.zo_perturb import zo_perturb_, zo_seed


@dataclass
class ZOHyper:
    """Hyper-parameters of a ZO run (the ``optim_args`` of method ``zo``)."""

    eps: float = 1e-3  # perturbation scale
    n_samples: int = 1  # perturbations (forward pairs) per step
    weight_decay: float = 0.0  # decoupled decay, applied before the ZO update
    momentum: float = 0.0  # windowed ZO momentum factor (0 = plain MeZO-SGD)
    momentum_window: int = 0  # steps summed by the momentum (0 = auto: until momentum**k < 1e-2, max 16)
    sparsity: float = 0.0  # Sparse MeZO: share of entries NOT perturbed (largest |w|); 0 = dense
    mask_every: int = 50  # Sparse MeZO: steps between threshold recomputations

    def __post_init__(self) -> None:
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ConfigError(f"eps={self.eps!r} must be a positive finite number (try 1e-3)")
        if int(self.n_samples) < 1:
            raise ConfigError(f"n_samples={self.n_samples!r} must be >= 1")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum={self.momentum!r} must be in [0, 1)")
        if int(self.momentum_window) < 0:
            raise ConfigError(f"momentum_window={self.momentum_window!r} must be >= 0 (0 = auto)")
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"sparsity={self.sparsity!r} must be in [0, 1)")
        if int(self.mask_every) < 1:
            raise ConfigError(f"mask_every={self.mask_every!r} must be >= 1")
        self.n_samples = int(self.n_samples)
        self.momentum_window = int(self.momentum_window)
        self.mask_every = int(self.mask_every)

    @property
    def window(self) -> int:
        """Number of past steps the update sums over (1 without momentum)."""
        if self.momentum == 0.0:
            return 1
        if self.momentum_window:
            return self.momentum_window
        return min(16, max(1, math.ceil(math.log(1e-2) / math.log(self.momentum))))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rule(self, n_params: int) -> "ZORule":
        """The update rule these hyper-parameters define over ``n_params`` parameters: what
        the block schedule (:mod:`outcore.offload.zo.engine`) applies, without importing it."""
        return ZORule(self, n_params)

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "ZOHyper":
        """Build from an ``optim_args`` mapping, ignoring keys that are not ZO hyper-parameters."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(args) - names - {"seed"})
        if unknown:
            raise ConfigError(f"optim_args.{unknown[0]} is not a ZO option; known: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in args.items() if k in names})


@dataclass
class StepRecord:
    """What a ZO step leaves behind: enough to replay it exactly (bytes, not tensors)."""

    step: int  # 1-based
    seeds: list[int]  # one per perturbation sample
    grads: list[float]  # projected gradients, same order
    lr: float  # learning rate used by this step's update
    loss: float = float("nan")  # mean of the +/- losses (for the metrics only)
    thresholds: list[float] | None = None  # Sparse MeZO thresholds set at this step

    def to_json(self) -> dict[str, Any]:
        d = {"step": self.step, "seeds": self.seeds, "grads": self.grads, "lr": self.lr,
             "loss": self.loss}
        if self.thresholds is not None:
            d["thresholds"] = self.thresholds
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StepRecord":
        return cls(step=int(d["step"]), seeds=[int(s) for s in d["seeds"]],
                   grads=[float(g) for g in d["grads"]], lr=float(d["lr"]),
                   loss=float(d.get("loss", float("nan"))), thresholds=d.get("thresholds"))


@dataclass
class ZOState:
    """The only state a ZO run carries: recent records (momentum window) and thresholds."""

    hyper: ZOHyper
    history: list[StepRecord] = field(default_factory=list)  # the last `window` records
    thresholds: list[float] | None = None  # per parameter index (Sparse MeZO)
    backend: str | None = None  # where z is drawn (kernels/zo_perturb.py; None: the device's own)

    def push(self, rec: StepRecord) -> None:
        self.history.append(rec)
        del self.history[:-self.hyper.window]


def sample_seeds(run_seed: int, step: int, n: int) -> list[int]:
    """Seeds of the ``n`` perturbation samples of ``step`` (the same on every rank)."""
    base = zo_seed(run_seed, step)
    return [zo_seed(base, i) for i in range(n)]


def mask_for(w: torch.Tensor, state: ZOState, index: int) -> torch.Tensor | None:
    """The Sparse MeZO mask of parameter ``index`` from its current values (None = dense).

    Args:
        w: the parameter's clean values, any shape.
        state: run state holding the thresholds.
        index: the parameter's index.

    Returns:
        A bool tensor of ``w``'s shape, or None when the run is dense.
    """
    if state.thresholds is None:
        return None
    return w.abs() <= state.thresholds[index]  # transient: dropped right after use


def threshold_of(w: torch.Tensor, sparsity: float) -> float:
    """The ``(1 - sparsity)`` quantile of ``|w|``: entries at or below it are perturbed.

    Args:
        w: a parameter, any shape.
        sparsity: share of entries to leave out, in [0, 1).

    Returns:
        The threshold as a Python float (exact fp32 value).
    """
    flat = w.detach().reshape(-1).abs().float()
    k = max(1, math.ceil((1.0 - sparsity) * flat.numel()))
    return float(flat.kthvalue(k).values)


def needs_thresholds(hyper: ZOHyper, step: int) -> bool:
    """True when Sparse MeZO recomputes its thresholds at the start of ``step`` (1-based)."""
    return hyper.sparsity > 0 and (step - 1) % hyper.mask_every == 0


def perturb_(w: torch.Tensor, seed: int, index: int, scale: float, mask: torch.Tensor | None,
             src: torch.Tensor | None = None, backend: str | None = None) -> None:
    """``w = src + scale * z(seed, index) * mask`` (one sample, one parameter; ``z`` drawn by
    ``backend``, see ``kernels/zo_perturb.py``)."""
    zo_perturb_(w, zo_seed(seed, index), scale, mask=mask, src=src, backend=backend)


def apply_update_(w: torch.Tensor, index: int, state: ZOState) -> None:
    """Apply the update of the newest record in ``state.history`` to parameter ``index``.

    Args:
        w: the parameter's clean values (any shape), updated in place.
        index: the parameter's index (selects z).
        state: run state; ``state.history[-1]`` is the step being applied.
    """
    hyper = state.hyper
    rec = state.history[-1]
    mask = mask_for(w, state, index)
    if hyper.weight_decay:
        w.mul_(1.0 - rec.lr * hyper.weight_decay)
    for k, past in enumerate(reversed(state.history)):
        coef = -rec.lr * (hyper.momentum ** k) / len(past.seeds)
        for seed, g in zip(past.seeds, past.grads):
            if g != 0.0:
                perturb_(w, seed, index, coef * g, mask, backend=state.backend)


def projected_grads(losses_plus: Sequence[float], losses_minus: Sequence[float], eps: float) -> list[float]:
    """``(L+ - L-) / (2 eps)`` per sample, in Python floats (what the log stores)."""
    return [(lp - lm) / (2.0 * eps) for lp, lm in zip(losses_plus, losses_minus)]


class ZORule:
    """The MeZO / Sparse MeZO math the ZO block schedule applies, one parameter at a time.

    The schedule (:mod:`outcore.offload.zo.engine`) owns the order of visits and the
    memory; this object owns the run's ZO state (momentum window, thresholds) and
    the update, so the schedule needs no optimizer internals. Build it with
    :meth:`ZOHyper.rule`.

    Args:
        hyper: the run's hyper-parameters.
        n_params: trainable parameters (indices ``0 .. n_params - 1`` select z).
    """

    def __init__(self, hyper: ZOHyper, n_params: int) -> None:
        self.hyper = hyper
        self.state = ZOState(hyper, thresholds=[0.0] * n_params if hyper.sparsity > 0 else None)

    def seeds(self, run_seed: int, step: int) -> list[int]:
        """The perturbation seeds of ``step`` (1-based), the same on every rank."""
        return sample_seeds(run_seed, step, self.hyper.n_samples)

    def update_(self, w: torch.Tensor, index: int) -> None:
        """Apply the newest record's update to parameter ``index``'s clean weights, in place."""
        apply_update_(w, index, self.state)

    def refresh_threshold(self, w: torch.Tensor, index: int, step: int) -> None:
        """Sparse MeZO: recompute parameter ``index``'s threshold when ``step`` starts a mask period."""
        if needs_thresholds(self.hyper, step):
            self.state.thresholds[index] = threshold_of(w, self.hyper.sparsity)

    def mask(self, w: torch.Tensor, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s Sparse MeZO mask from its clean weights (None when dense)."""
        return mask_for(w, self.state, index)

    def delta_(self, d: torch.Tensor, seed: int, index: int, mask: torch.Tensor | None) -> None:
        """``d = fl32(eps * z(seed, index)) * mask``: one draw serves both signs (``w + d``, ``w - d``)."""
        d.zero_()
        perturb_(d, seed, index, self.hyper.eps, mask, backend=self.state.backend)  # 0 + d == d exactly

    def record(self, step: int, seeds: list[int], plus: list[float], minus: list[float],
               lr: float) -> StepRecord:
        """Close ``step``: its record (projected gradients from the losses), pushed as the newest.

        Args:
            step: the step (1-based).
            seeds: its sample seeds.
            plus, minus: every sample's loss at ``w + eps z`` and ``w - eps z``.
            lr: the learning rate its update uses.

        Returns:
            The record; :meth:`update_` applies it from now on.
        """
        n = len(seeds)
        rec = StepRecord(step=step, seeds=seeds, grads=projected_grads(plus, minus, self.hyper.eps),
                         lr=float(lr), loss=(sum(plus) + sum(minus)) / (2 * n),
                         thresholds=list(self.state.thresholds) if needs_thresholds(self.hyper, step) else None)
        self.state.push(rec)
        return rec

    def resume(self, records: list[StepRecord]) -> None:
        """Continue after ``records``, whose updates are already in the weights."""
        self.state.history = list(records[-self.hyper.window:])
        for rec in records:
            if rec.thresholds is not None:
                self.state.thresholds = list(rec.thresholds)
