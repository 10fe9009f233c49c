"""Distributed ZO on ``torch.distributed``: ranks exchange (seed, scalar) pairs, never tensors.

Every rank holds the whole model (or streams it from its own disk) and derives
the same sample seeds from the run seed, so after the losses are exchanged each
rank applies the identical update and the replicas stay bit-identical without
ever sending a weight or a gradient. Per step the wire carries ``n`` seeds and
``2n`` losses — bytes, not gigabytes.

Two ways to split the work (:class:`~outcore.offload.zo.engine.ZOBlockTrainer`'s
``split``):

* ``"samples"`` — sample ``i`` runs on rank ``i % world``, all ranks on the same
  batch. The result is bit-identical to a one-process run with the same
  ``n_samples`` (tested with 2 gloo processes).
* ``"data"`` — every rank evaluates all samples on its own batch; the losses
  are averaged across ranks (data parallel ZO).

Launch with ``torchrun --nproc-per-node N your_script.py`` (gloo on CPU, nccl on
GPU), join the group with :func:`outcore.offload.distributed.ranks.join` and build the trainer
with :func:`distributed_trainer`.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import ConfigError
from .engine import Exchange, ZOBlockTrainer


def make_exchange(split: str = "samples", group: Any = None) -> Exchange:
    """An exchange function over the default (or given) process group.

    Args:
        split: ``"samples"`` or ``"data"`` (see the module docstring).
        group: a ``torch.distributed`` group (None = the default group).

    Returns:
        ``exchange(step, seeds, plus, minus, mine) -> (plus, minus)`` for all samples.

    Raises:
        ConfigError: an unknown split.
    """
    import torch.distributed as dist

    if split not in ("samples", "data"):
        raise ConfigError(f"split={split!r} must be 'samples' or 'data'")
    dev = "cuda" if dist.get_backend(group) == "nccl" else "cpu"

    def exchange(step: int, seeds: list[int], plus: list[float], minus: list[float],
                 mine: list[int]) -> tuple[list[float], list[float]]:
        n = len(seeds)
        # the seeds travel too, as a check: every rank must have drawn the same ones
        all_seeds = [torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size(group))]
        dist.all_gather(all_seeds, torch.tensor(seeds, dtype=torch.int64, device=dev), group=group)
        if any(not torch.equal(s, all_seeds[0]) for s in all_seeds):
            raise ConfigError(f"step {step}: ranks drew different seeds; start every rank with the same run seed")
        vals = torch.zeros(2, n, dtype=torch.float64, device=dev)
        for i in mine:
            vals[0, i], vals[1, i] = plus[i], minus[i]
        # sync point: every rank needs every loss before it can update
        dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
        if split == "data":
            vals /= dist.get_world_size(group)
        # "samples": each slot came from exactly one rank, the others added exact zeros
        return vals[0].tolist(), vals[1].tolist()

    return exchange


def distributed_trainer(model: torch.nn.Module, hyper: Any, seed: int = 0, split: str = "samples",
                        **kwargs: Any) -> ZOBlockTrainer:
    """A :class:`ZOBlockTrainer` for this rank of the initialized process group.

    Args:
        model: the model, identical on every rank.
        hyper: ZO hyper-parameters, a :class:`outcore.optim.zo_core.ZOHyper` (``n_samples`` is
            the total over ranks with split "samples").
        seed: the run seed, identical on every rank.
        split: ``"samples"`` or ``"data"``.
        **kwargs: passed to :class:`ZOBlockTrainer` (``swap_dir``, ``prefetch``).

    Returns:
        The trainer.

    Raises:
        ConfigError: torch.distributed is not initialized.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialized; "
                          "call outcore.offload.distributed.ranks.join() under torchrun first")
    rank, world = dist.get_rank(), dist.get_world_size()
    return ZOBlockTrainer(model, hyper, seed=seed, rank=rank, world=world,
                          exchange=make_exchange(split), split=split, **kwargs)
