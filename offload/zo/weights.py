"""Where the ZO schedule gets each block's clean weights: the model's own tensors, or the store.

* :class:`HostWeights` — in memory: a parameter's clean weights are its own tensor.
* :class:`StoreWeights` — streamed from NVMe through the same
  :class:`~outcore.offload.store.store.TieredStore` and
  :class:`~outcore.offload.engine.unit_memory.StoreUnitMemory` first-order training
  uses: one checksummed handle per unit, budgeted, counted in
  ``store.tier_stats()``. The model's parameters are emptied; the process holds
  only the few units the DEVICE window has room for, so a model larger than RAM trains.

Protocol (what :class:`~outcore.offload.zo.engine.ZOBlockTrainer` calls)::

    tensors = weights.acquire(b)    # clean tensors of block b, in blocks.blocks[b] order
    weights.prefetch(b2)            # hint: block b2 is needed soon
    weights.before_update(b)        # b's own weights are about to change in place
    weights.release(b, dirty)       # done with b; write it back if dirty
    weights.close()
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..device import Device
from ..engine import WEIGHTS, ParamSlot, StoreUnitMemory, place_rest
from ..engine.unit_sizes import weights_arena_bytes, window_bytes
from ..store import Tier, TieredStore
from .model import CausalLMBlocks


class HostWeights:
    """Blocks whose clean weights are the model's parameters, in RAM (no I/O): the
    protocol's calls other than :meth:`acquire` have nothing to do."""

    stall_s = 0.0

    def __init__(self, blocks: CausalLMBlocks) -> None:
        self._clean = [[q.param.data for q in params] for params in blocks.blocks]

    def acquire(self, b: int) -> list[torch.Tensor]:
        return self._clean[b]

    def prefetch(self, b: int) -> None:
        return None

    def before_update(self, b: int) -> None:
        return None

    def release(self, b: int, dirty: bool) -> None:
        return None

    def tier_stats(self) -> dict:
        return {}  # nothing moves between tiers

    def close(self) -> None:
        return None


class StoreWeights:
    """Blocks streamed from NVMe through a TieredStore and its unit memory, updated in place.

    Args:
        blocks: the model's blocks; every parameter's current value (or, on the meta
            device, ``init_weights``'s) is written to the swap directory and the
            parameters are emptied.
        swap_dir: the run's swap directory (created 0700 and locked by the store;
            removed on :meth:`close`).
        prefetch: units fetched ahead of the one computing.
        init_weights: fills a parameter ``(slot, view)`` of a model built on the meta
            device as its unit is stored, so the model never exists whole in RAM.
        device: where the blocks compute (the DEVICE tier's memory; default: the blocks').

    Raises:
        SwapDirError: the swap directory cannot be used.
    """

    def __init__(self, blocks: CausalLMBlocks, swap_dir: str | Path, prefetch: int = 2,
                 init_weights: Callable[[ParamSlot, torch.Tensor], None] | None = None,
                 device: torch.device | None = None) -> None:
        self.units, self.blocks = blocks.units, blocks
        self.depth = max(0, int(prefetch))
        sizes = [weights_arena_bytes(u) for u in self.units]
        # the largest unit (the embedding) once; the unit computing, `depth` prefetched and two
        # whose write-backs are still landing (a fetch finding no room would wait for them)
        window = window_bytes(sizes, self.depth + 3)
        compute = Device(device or blocks.device)  # the store's, closed with it
        # on an accelerator, disk -> device is staged in pinned HOST memory (freed as each copy
        # lands): the same window again; the swap file holds every unit's weights once
        self.store = TieredStore(device_bytes=window, host_bytes=window if compute.is_accelerator else 4096,
                                 nvme_bytes=None, swap_dir=swap_dir, device=compute, nvme_reserve=sum(sizes))
        try:
            # no optimizer state, and no fp32 masters: ZO updates the weights themselves
            self.mem = StoreUnitMemory(self.store, self.units, None,
                                       homes=[(Tier.NVME,) * 3] * len(self.units),
                                       init_weights=init_weights, master_weights=False)
            place_rest(blocks.model, self.units, compute.torch_device)  # buffers (RoPE's frequencies)
            # A unit another one borrows (the tied embedding) is used at both ends of every
            # step: this pin holds it for the whole run, read once, where it was first placed (at
            # the top of the arena: fetched again later, it could find the top split by a block).
            self._resident = {o for u in self.units for o in u.borrows}
            for u in sorted(self._resident):
                self.mem.acquire(u, WEIGHTS)
        except BaseException:
            self.store.close()
            raise

    @property
    def stall_s(self) -> float:
        """Seconds the schedule waited for a read, since the start."""
        return self.mem.stall_s

    def _needs(self, b: int) -> list[int]:
        """The units block ``b`` computes with: its own and those it borrows (the tied head)."""
        return [b, *self.units[b].borrows]

    def acquire(self, b: int) -> list[torch.Tensor]:
        """Block ``b``'s clean weights, views into its unit's pinned DEVICE copy (and the
        borrowed unit's). Waits only when the read is late: a stall, counted in ``stall_s``."""
        flats = {u: self.mem.acquire(u, WEIGHTS) for u in self._needs(b)}
        return [self.units[q.unit].view(flats[q.unit], q.slot) for q in self.blocks.blocks[b]]

    def prefetch(self, b: int) -> None:
        """Start reading block ``b`` (modulo the block count: the next step's first blocks
        are read while this step's last ones compute)."""
        for u in self._needs(b % len(self.units)):
            self.mem.prefetch(u, WEIGHTS)

    def before_update(self, b: int) -> None:
        """Wait until block ``b``'s previous write-back has read its bytes: they change next."""
        self.mem.before_update(b, WEIGHTS)

    def release(self, b: int, dirty: bool) -> None:
        """Done with block ``b``: its update is written home asynchronously when ``dirty``. A unit
        pinned for the run (the tied embedding) stays resident and is never written home: the
        run's own pin outlives every release, and its DEVICE copy is the newest."""
        for u in self._needs(b):
            self.mem.release(u, WEIGHTS, dirty=dirty and u == b, keep=u in self._resident)

    def tier_stats(self) -> dict:
        """The store's per-tier occupancy and traffic (bandwidth since the previous call)."""
        return self.store.tier_stats(window=True)

    def close(self) -> None:
        """Finish every write-back, free the arenas and remove the swap directory."""
        try:
            self.mem.flush()
        finally:
            self.store.close()
