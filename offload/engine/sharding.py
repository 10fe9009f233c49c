"""Sharded out-of-core data parallelism: each rank owns 1/N of every unit's optimizer state.

ZeRO's idea with outcore's streaming underneath (docs/architecture.md §10; issue #17). Every
rank holds the whole model's weights (streamed from its own swap directory) and computes
the forward and backward of its own micro-batches; a unit's trainable elements are cut into
``world`` equal ranges and rank ``r`` keeps the optimizer state (and spilled gradients) of
range ``r`` only. When a unit's gradients complete on every rank they are summed across the
ranks and scattered (``reduce_scatter``: rank ``r`` receives range ``r``), the rank updates
its range with its state, and the updated ranges are gathered (``all_gather``) into every
rank's full weights before the next use — all inside the backward, unit by unit, while
autograd goes on with earlier units.

**The shard space.** A unit's trainable parameters are laid back to back, each padded to a
multiple of ``PIECE_ALIGN`` elements, and the total padded up to ``world`` equal ranges of a
multiple of ``PIECE_ALIGN`` each (``torch.chunk`` of ``[rows, PIECE_ALIGN]`` rows: the
layout ``Shard(0)`` of a DTensor has, so a checkpoint reshards to another world size). A
range therefore starts every parameter it cuts on a ``PIECE_ALIGN`` boundary of that
parameter: it is exactly a run of *pieces* (``UnitLayout.pieces``), and the piece machinery stores
and updates it — only the rank's range is pieced, nothing else exists on the rank.

**Exactness.** Each rank scales its loss by 1 / (world x micro-batches), as one rank
accumulating ``world x micro-batches`` would, so the summed gradient of two ranks is
``g0/2 + g1/2`` — the sum one rank accumulates, in either order. The updates are
element-wise, so 2 ranks x B give 1 rank x 2B's weights bit for bit without clipping; with
clipping the global norm is the square root of the summed squares of the ranks' shard
norms (another summation order: equal within fp32 rounding).

The transport is ``torch.distributed`` over the default process group (gloo on CPUs, NCCL
on GPUs); every rank reaches the collectives in the same order, since every rank runs the
same model's hooks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError
from ..distributed import Ranks, flat_collectives
from .tied_embedding import dense_range
from .unit_sizes import PIECE_ALIGN
from .units import Unit


#: elements of a rank's range one collective carries: a unit's reduce and gather hold
#: world x this in transient buffers (64 MiB of fp32 at 2 ranks), not the unit's size
CHUNK = 1 << 23


@dataclass(frozen=True)
class Shard:
    """Where a unit's trainable elements lie in the shard space, and which range is this rank's.

    Attributes:
        rank, world: this rank and the number of ranks.
        bases: per trainable slot index, where the slot starts in the shard space.
        numels: per trainable slot index, its elements.
        length: elements per rank (a multiple of ``PIECE_ALIGN``).
    """

    rank: int
    world: int
    bases: dict[int, int]
    numels: dict[int, int]
    length: int

    @classmethod
    def of(cls, unit: Unit, ranks: Ranks) -> "Shard":
        """The shard of ``unit`` (its trainable slots) for ``ranks``."""
        bases, numels, at = {}, {}, 0
        for k in unit.train_slots:
            bases[k], numels[k] = at, unit.slots[k].numel
            at += -(-numels[k] // PIECE_ALIGN) * PIECE_ALIGN
        rows = at // PIECE_ALIGN
        return cls(ranks.rank, ranks.world, bases, numels, -(-rows // ranks.world) * PIECE_ALIGN)

    @property
    def lo(self) -> int:
        """First element of this rank's range in the shard space."""
        return self.rank * self.length

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        """(slot, lo, hi): the elements of each trainable slot this rank owns, in slot order."""
        return [(k, lo, hi) for k, lo, hi, _ in self.overlaps(self.lo, self.lo + self.length)]

    def overlaps(self, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """(slot, lo, hi, at): the elements [lo, hi) of each slot that lie in [a, b) of the shard
        space, ``at`` elements after ``a``."""
        out = []
        for k, base in self.bases.items():
            lo, hi = max(a - base, 0), min(b - base, self.numels[k])
            if lo < hi:
                out.append((k, lo, hi, base + lo - a))
        return out

    def chunks(self) -> list[tuple[int, int]]:
        """[j0, j1) of a rank's range, ``CHUNK`` at a time: what one collective carries per rank."""
        return [(j, min(self.length, j + CHUNK)) for j in range(0, self.length, CHUNK)]

    def at(self, k: int, e: int) -> int:
        """Where element ``e`` of slot ``k`` lies in this rank's range (a local index)."""
        return self.bases[k] + e - self.lo


def shard_units(units: list[Unit], optimizer: Any, ranks: Ranks | None, resident_trainable: bool = False) -> int:
    """Give every unit with trainable parameters its :class:`Shard` (``Unit.shard``) when
    there are several ranks.

    Args:
        units: the model's units, not yet stored.
        optimizer: the ``OutcoreOptimizer`` over their trainable parameters.
        ranks: this process among the ranks (None: one rank, nothing to shard).
        resident_trainable: LoRA / QLoRA (adapters train resident: not sharded here).

    Returns:
        The number of ranks.

    Raises:
        ConfigError: adapters, or an optimizer that does not update element-wise, so its state
            cannot be cut into ranges (``OutcoreOptimizer.elementwise_state``).
    """
    if ranks is None or ranks.world == 1:
        return 1
    if resident_trainable:
        raise ConfigError("LoRA / QLoRA out of core trains resident adapters; sharded data parallelism "
                          "is for a full fine-tune (method full), or run LoRA on one rank")
    group = optimizer.param_groups[0]
    ratios_of = getattr(optimizer, "elementwise_state", None)
    for unit in units:
        train = unit.train_slots
        if train and (ratios_of is None or any(ratios_of(unit.slots[k].param, group) is None for k in train)):
            raise ConfigError(f"optimizer {type(optimizer).__name__} does not update element-wise, so its "
                              "state cannot be sharded across ranks; use adamw or adamw8bit, or one rank")
        if train:
            unit.shard = Shard.of(unit, ranks)
    return ranks.world


def reduce_grads(unit: Unit, grads: dict[int, torch.Tensor]) -> torch.Tensor:
    """Sum ``unit``'s gradients (slot -> gradient) over the ranks; return this rank's range of
    the sum, [length] (zero where the shard space pads). One ``reduce_scatter`` per chunk."""
    reduce_scatter, _ = flat_collectives()
    shard = unit.shard
    first = next(iter(grads.values()))
    dtype, device = first.dtype, first.device  # (NCCL reduces on the GPU, gloo on the CPU)
    mine = torch.empty(shard.length, dtype=dtype, device=device)
    for j0, j1 in shard.chunks():
        c = j1 - j0
        # every rank's [j0, j1) side by side: rank r receives the sum of its own
        send = torch.zeros(shard.world * c, dtype=dtype, device=device)
        for r in range(shard.world):
            for k, lo, hi, at in shard.overlaps(r * shard.length + j0, r * shard.length + j1):
                send[r * c + at:r * c + at + hi - lo].copy_(dense_range(grads[k], lo, hi))
        reduce_scatter(mine[j0:j1], send)
    return mine


def gather_weights(unit: Unit) -> None:
    """Gather every rank's updated range into ``unit.step.bound``, the whole weights, on every rank
    (one ``all_gather`` per chunk)."""
    _, all_gather = flat_collectives()
    shard, flat = unit.shard, unit.step.bound

    def weights(k: int) -> torch.Tensor:
        return unit.view(flat, unit.slots[k]).view(-1)

    for j0, j1 in shard.chunks():
        c = j1 - j0
        mine = torch.zeros(c, dtype=flat.dtype, device=flat.device)
        for k, lo, hi, at in shard.overlaps(shard.lo + j0, shard.lo + j1):
            mine[at:at + hi - lo].copy_(weights(k)[lo:hi])
        every = torch.empty(shard.world * c, dtype=flat.dtype, device=flat.device)
        all_gather(every, mine)
        for r in range(shard.world):
            for k, lo, hi, at in shard.overlaps(r * shard.length + j0, r * shard.length + j1):
                weights(k)[lo:hi].copy_(every[r * c + at:r * c + at + hi - lo])
