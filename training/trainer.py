"""The model in training, as a recipe steps it: one protocol, three implementations.

* ``training.in_memory.InMemoryModel`` — the model and optimizer in memory: the numerical
  reference every out-of-core mode is checked against, bit for bit;
* ``offload.engine.OutOfCoreEngine`` — weights and optimizer state streamed through the tiers;
* ``training.distributed.across_ranks.DataParallelAdapters`` — an engine training resident
  adapters on one of several ranks, their gradients summed before the step.

A recipe's loop sees only :class:`Trainer`. What else a run reports of its memory — the bytes
and traffic per tier, the time compute waited for a transfer — belongs to the run's
``TieredStore`` (one source for first- and zeroth-order runs alike, read by the run lifecycle);
checkpoints and exports of a streamed model ask the engine itself (``OutOfCoreEngine``: its
units and their memory). A caller that runs its own loop around the engine (a transformers
``Trainer``: ``integrations/trainer.py``) uses the engine's ``begin_step`` / ``micro_batch`` /
``clip`` / ``end_step``, which ``train_step`` is made of.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

#: ``(model, batch) -> mean loss`` (a scalar tensor): what every trainer runs per micro-batch
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@runtime_checkable
class Trainer(Protocol):
    """One optimizer step at a time over a model, wherever its weights and state live."""

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last step, before clipping (None: not computed)."""

    def train_step(self, loss_fn: LossFn, micro_batches: list[Any], lr: float) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` (their gradients accumulated) at ``lr``.

        Returns:
            The step's loss summed over its (accumulation-scaled) micro-batches, still a
            tensor: no host sync.
        """

    def close(self) -> None:
        """Release what the trainer holds (a streamed model's store and swap directory)."""
