"""Tiers, residency states and the one handle per swappable tensor (docs/architecture.md §3).

All state of a tensor lives on its :class:`TensorHandle`: per tier, whether a
copy is there (:class:`Residency`), where its bytes are (an arena block or an
NVMe extent), the transfer in flight and how many consumers pin it. There are
no side tables keyed by ``id(tensor)``; the store only keeps a list of handles.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


class Tier(enum.IntEnum):
    """A memory tier, fastest first (the integer order is the speed order)."""

    DEVICE = 0  # the compute device (CUDA memory, or a RAM arena on CPU-only machines)
    HOST = 1  # CPU RAM (pinned on CUDA machines)
    NVME = 2  # files in the swap directory

    @classmethod
    def parse(cls, value: "Tier | str") -> "Tier":
        """``Tier.HOST``, ``"host"`` or ``"HOST"`` -> ``Tier.HOST``.

        Raises:
            ValueError: an unknown tier name.
        """
        if isinstance(value, Tier):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise ValueError(f"unknown tier {value!r}; use one of device, host, nvme") from None


class Residency(enum.Enum):
    """The state of one tier's copy of a tensor."""

    ABSENT = "absent"  # no copy in this tier
    IN_FLIGHT = "in_flight"  # a transfer into this tier is running
    RESIDENT = "resident"  # a copy equal to the authoritative one
    DIRTY = "dirty"  # the newest copy: changed since the authoritative copy was written


@dataclass(eq=False)
class TierCopy:
    """One tier's copy of a tensor. Owned by its handle; mutated only under the store's lock."""

    residency: Residency = Residency.ABSENT
    slot: object | None = None  # arena Block (DEVICE/HOST) or Extent (NVME); None when ABSENT
    future: Future | None = None  # the transfer into this tier (done once it landed)
    writing: Future | None = None  # this (dirty) copy's write-back to the home tier, while it runs
    pins: int = 0  # consumers holding a view; a pinned copy is never evicted
    outgoing: list[Future] = field(default_factory=list)  # transfers reading this copy now
    generation: int = 0  # bumped by mark_dirty: a write-back of an older state must not mark it clean

    @property
    def valid(self) -> bool:
        """A copy that can be read (or will be, when its transfer completes)."""
        return self.residency is not Residency.ABSENT


@dataclass(eq=False)
class TensorHandle:
    """One swappable tensor: identity, layout, and the state of its copy in every tier.

    Create handles with :meth:`TieredStore.register`, never directly.
    """

    key: str  # unique name, e.g. "block3.mlp.up.weight:exp_avg"
    shape: tuple[int, ...]
    dtype: torch.dtype
    home: Tier  # the tier that holds the authoritative copy
    copies: dict[Tier, TierCopy] = field(default_factory=lambda: {t: TierCopy() for t in Tier})

    @classmethod
    def new(cls, key: str, shape: Iterable[int] | None, dtype: torch.dtype | None, home: "Tier | str",
            data: torch.Tensor | None = None) -> "TensorHandle":
        """A handle for ``register``: shape and dtype from the arguments or ``data``.

        Raises:
            ValueError: home is DEVICE, ``data`` does not match shape/dtype, or neither is given.
        """
        home = Tier.parse(home)
        if home is Tier.DEVICE:
            raise ValueError(f"home={home.name} for {key!r}: the authoritative copy lives in HOST or NVME")
        if data is not None:
            shape = data.shape if shape is None else shape
            dtype = data.dtype if dtype is None else dtype
            if tuple(data.shape) != tuple(shape) or data.dtype != dtype:
                raise ValueError(f"data for {key!r} is {data.dtype}{tuple(data.shape)}, "
                                 f"expected {dtype}{tuple(shape)}")
        if shape is None or dtype is None:
            raise ValueError(f"register({key!r}) needs shape and dtype, or data")
        return cls(key, tuple(int(d) for d in shape), dtype, home)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (not padded)."""
        return self.numel * self.dtype.itemsize

    def residency(self, tier: Tier | str) -> Residency:
        """The state of the copy in ``tier``."""
        return self.copies[Tier.parse(tier)].residency

    @property
    def dirty_tier(self) -> Tier | None:
        """The tier whose copy is newer than the authoritative one, if any."""
        for t, c in self.copies.items():
            if c.residency is Residency.DIRTY:
                return t
        return None

    def newest(self) -> Tier | None:
        """The tier holding the newest settled copy (dirty, else resident, else home); None = zeros."""
        d = self.dirty_tier
        if d is not None:
            return d
        for t in Tier:
            if self.copies[t].residency is Residency.RESIDENT:
                return t
        return self.home if self.copies[self.home].valid else None

    def source_for(self, target: Tier) -> Tier | None:
        """The settled copy to copy into ``target`` from: the dirty one, else the fastest resident
        one; None = zeros. Copies still in flight are never sources (the home copy is always
        settled), so a transfer never waits on another one — no cycles."""
        d = self.dirty_tier
        if d is not None:
            return d
        order = [Tier.HOST, Tier.DEVICE, Tier.NVME] if target is Tier.DEVICE else [Tier.DEVICE, Tier.HOST, Tier.NVME]
        for t in order:
            if t is not target and self.copies[t].residency is Residency.RESIDENT:
                return t
        return None

    def __repr__(self) -> str:
        where = ", ".join(f"{t.name}={c.residency.value}" for t, c in self.copies.items() if c.valid)
        return (f"TensorHandle({self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"home={self.home.name}, {where or 'unset'})")
