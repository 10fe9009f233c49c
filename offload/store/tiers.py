"""The bytes of every tier behind one budgeted allocator (docs/architecture.md §3).

:class:`TierSpace` owns the physical memory of a :class:`~outcore.offload.store.store.TieredStore`:
the DEVICE and HOST :class:`Arena` s and the NVMe :class:`NvmeBackend` (its swap
file in a locked :class:`SwapDir`). It hands out *slots* — an arena ``Block`` or an
NVMe ``Extent`` — and never more than a tier's budget: a request that does not fit
raises :class:`BudgetError` naming the tier, its budget, the bytes held and the
request. It knows nothing about handles' residency; the store does.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import BudgetError
from .arena import Arena
from ..aligned import align_up, aligned_empty
from ..device import Device
from .directio import IOPool
from .handle import Tier
from .nvme import NvmeBackend
from .swapdir import SwapDir


def format_size(n: int | None) -> str:
    """``n`` bytes as MiB / GiB for messages (None: unbounded)."""
    if n is None:
        return "unbounded"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class TierSpace:
    """DEVICE / HOST arenas and the NVMe swap file, each with its byte budget.

    Args:
        device: the :class:`Device` whose slab allocators back the arenas.
        device_bytes, host_bytes: arena budgets (0: tier unused).
        nvme_bytes: NVME budget, preallocated now; ``None`` = grow on demand.
        swap_dir: the swap directory (None: no NVME tier).
        queue_depth, chunk_bytes: the NVMe I/O pool's syscalls in flight and largest syscall.
        slab_bytes: arena slab size (default: one slab per tier).
        direct: use ``O_DIRECT`` where the file system allows it.

    Raises:
        BudgetError: a negative budget.
        SwapDirError: the swap dir cannot be used or is too small for ``nvme_bytes``.
    """

    def __init__(self, device: Device, device_bytes: int, host_bytes: int, nvme_bytes: int | None,
                 swap_dir: str | Path | SwapDir | None, *, queue_depth: int, chunk_bytes: int,
                 slab_bytes: int | None = None, direct: bool = True):
        for name, b in (("device_bytes", device_bytes), ("host_bytes", host_bytes), ("nvme_bytes", nvme_bytes)):
            if b is not None and b < 0:
                raise BudgetError(f"{name}={b} must be >= 0")
        self.arenas = {Tier.DEVICE: Arena(device_bytes, device.alloc_device_slab, slab_bytes),
                       Tier.HOST: Arena(host_bytes, device.alloc_host_slab, slab_bytes)}
        self.swap: SwapDir | None = None
        self.nvme: NvmeBackend | None = None
        if swap_dir is not None:
            self.swap = swap_dir if isinstance(swap_dir, SwapDir) else SwapDir(swap_dir)
            pool = IOPool(queue_depth, chunk_bytes)
            try:
                self.nvme = NvmeBackend(self.swap, nvme_bytes, pool, direct=direct)
            except BaseException:  # e.g. the disk is too small: leave nothing behind
                pool.close()
                self.swap.close()
                raise
            self.nvme._own_pool = True  # closed with the backend

    def budget(self, tier: Tier) -> int | None:
        """The tier's budget in bytes (None: NVME without a bound; 0: tier unused)."""
        if tier is Tier.NVME:
            return None if self.nvme is None or self.nvme.budget is None else self.nvme.budget
        return self.arenas[tier].budget

    def held(self, tier: Tier) -> int:
        """Bytes the tier has handed out now (block sizes, 4 KiB padding included)."""
        if tier is Tier.NVME:
            return 0 if self.nvme is None else self.nvme.held
        return self.arenas[tier].held

    def budget_error(self, tier: Tier, key: str, nbytes: int, why: str = "", what: str | None = None,
                     advice: str | None = None) -> BudgetError:
        """The error for a request of ``nbytes`` (tensor ``key``, described as ``what``) that
        ``tier`` cannot hold, ending with ``advice`` (what to do; default: the store's)."""
        budget = ("none (no swap_dir)" if tier is Tier.NVME and self.nvme is None
                  else format_size(self.budget(tier)))
        return BudgetError(
            f"{tier.name} tier budget {budget} cannot hold {what or repr(key)} "
            f"({format_size(align_up(nbytes))} requested, {format_size(self.held(tier))} held{why}); "
            + (advice or f"raise the {tier.name.lower()} budget, evict, or fetch fewer tensors at once"))

    def alloc(self, tier: Tier, key: str, nbytes: int):
        """A slot for ``nbytes`` (tensor ``key``) in ``tier``: an arena Block or an NVMe Extent.

        Raises:
            BudgetError: no NVME tier, or the tier has no room (fragmentation named).
        """
        if tier is Tier.NVME:
            if self.nvme is None:
                raise BudgetError(f"NVME tier is not set up (no swap_dir) but {key!r} has home NVME; "
                                  "pass swap_dir or register it with home='host'")
            ext = self.nvme.alloc(key, nbytes)
            if ext is None:
                raise self.budget_error(tier, key, nbytes)
            return ext
        arena = self.arenas[tier]
        if align_up(max(nbytes, 1)) > arena.slab_bytes:
            raise self.budget_error(tier, key, nbytes, ", larger than the whole tier")
        blk = arena.alloc(nbytes)
        if blk is None:
            frag = arena.largest_free
            raise self.budget_error(tier, key, nbytes, f", largest free block {format_size(frag)}" if frag else "")
        return blk

    def free(self, tier: Tier, slot) -> None:
        """Return a slot from :meth:`alloc`."""
        (self.nvme if tier is Tier.NVME else self.arenas[tier]).free(slot)

    def bytes_of(self, tier: Tier, slot) -> torch.Tensor:
        """A DEVICE / HOST slot's bytes as uint8 ``[slot.nbytes]`` (padding included)."""
        return self.arenas[tier].bytes_of(slot)

    def view(self, tier: Tier, slot, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A DEVICE / HOST slot as a tensor of ``shape`` / ``dtype`` (no copy)."""
        return self.arenas[tier].view(slot, shape, dtype)

    def write_initial(self, tier: Tier, slot, data: torch.Tensor | None) -> int:
        """Give a new tensor's home ``slot`` its first value: ``data`` (any CPU tensor), or zeros.

        Blocks until the bytes are there. An NVMe write stages through one transient
        aligned buffer (``O_DIRECT`` needs aligned memory); NVMe needs ``data``.

        Returns:
            The bytes written into ``tier`` (0 for a HOST tensor: no transfer).
        """
        n = 0 if data is None else data.numel() * data.element_size()
        if tier is not Tier.NVME:
            raw = self.bytes_of(tier, slot)
            if data is None:
                raw.zero_()
            else:
                raw[:n].view(data.dtype).view(data.shape).copy_(data)
            return 0
        stage = aligned_empty(slot.length)
        stage[:n].view(data.dtype).view(data.shape).copy_(data)
        self.nvme.write(slot, stage).result()
        return stage.numel()

    def read_new(self, ext, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A fresh CPU tensor ``[shape]`` read from NVMe extent ``ext`` (blocks; checksummed)."""
        buf = aligned_empty(ext.length, populate=False)
        self.nvme.read(ext, buf).result()
        return buf[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Release the swap file and directory and drop the arenas' slabs."""
        if self.nvme is not None:
            self.nvme.close()
        if self.swap is not None:
            self.swap.close()
        for a in self.arenas.values():
            a.release_slabs()
