"""A model trained in memory: a :class:`~outcore.training.trainer.Trainer`, as the out-of-core engine is.

So the recipe runs one loop whether the weights stream through the tiers or not.
This is the numerical reference every out-of-core mode is checked against, bit for
bit: per micro-batch forward and backward of ``loss / n``, then clip, step, zero.
Under torchrun each rank runs its share of the micro-batches and the gradients are summed
across the ranks before the step (``training/distributed/across_ranks.py``): the same step.
"""
from __future__ import annotations

from typing import Any

import torch

from ..offload.distributed import Ranks
from ..offload.engine import step_in_memory
from .distributed.across_ranks import SINGLE, accumulate
from .trainer import LossFn


class InMemoryModel:
    """``model`` and ``optimizer`` in memory; :meth:`train_step` = one optimizer step.

    Args:
        model: the model in training (its trainable parameters are ``optimizer``'s).
        optimizer: any torch optimizer over ``params``.
        params: the trainable parameters, in model order (what is clipped).
        max_grad_norm: global-norm clipping before each step; 0 disables it.
        ranks: the ranks training this model data parallel (each holds a replica).
        output: the run's output directory (named in the error when a rank is lost).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 params: list[torch.nn.Parameter], max_grad_norm: float, ranks: Ranks = SINGLE,
                 output: str | None = None) -> None:
        self.model, self.optimizer, self.params = model, optimizer, params
        self.ranks, self.output = ranks, output
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None

    def train_step(self, loss_fn: LossFn, micro_batches: list[Any], lr: float) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` (the gradients are accumulated).

        Args:
            loss_fn: ``(model, batch) -> mean loss`` (a scalar tensor).
            micro_batches: this rank's batches of the step; each loss is scaled by
                ``1 / (len · world)`` (the gradients are summed over the ranks).
            lr: this step's learning rate (set on every parameter group).

        Returns:
            The summed (accumulation-scaled) loss of the step over every rank, still a
            tensor: no host sync here.
        """
        total = accumulate(self.model, loss_fn, micro_batches, self.params, self.ranks, self.output)
        self.last_grad_norm = step_in_memory(self.params, self.optimizer, self.max_grad_norm, lr)
        return total

    def close(self) -> None:
        """Nothing to release (the model and optimizer are the caller's)."""
