"""Anonymous NVMe extents of a :class:`~outcore.offload.store.store.TieredStore` (docs/architecture.md §3).

Some bytes go to disk once and come back once, with no tensor of their own: a
block's offloaded activations are written in the forward, read in the backward
and forgotten. A :class:`TensorHandle` would give them residency, pins and a
home they never use, and a slot in the HOST arena to stage through; an
*anonymous extent* is only a reserved range of the swap file. The caller brings
its own aligned buffer and gets a Future per transfer.

What the store still does for them is what it does for every handle: the NVME
budget applies (a request that does not fit is a one-line :class:`BudgetError`),
each completed transfer is counted in the store's :class:`TierTraffic` (HOST ->
NVME written, NVME -> HOST read: the dashboard's NVMe line and the SSD wear
counters), and :meth:`TieredStore.synchronize` waits for transfers in flight.
The bytes are checksummed like every extent (``nvme.py``).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from ._futures import then
from .handle import Tier
from .nvme import Extent, NvmeBackend
from .tiers import TierSpace
from .traffic import TierTraffic


class AnonymousExtents:
    """The extent calls of :class:`TieredStore` (mixed into it; it sets ``space``, ``nvme``
    and ``traffic`` and calls :meth:`_init_extents`)."""

    space: TierSpace
    nvme: NvmeBackend | None
    traffic: TierTraffic

    def _init_extents(self) -> None:
        self._extent_lock = threading.Lock()
        self._extent_io: set[Future] = set()  # transfers in flight, for synchronize()

    def alloc_extent(self, key: str, nbytes: int, what: str | None = None, advice: str | None = None) -> Extent:
        """Reserve ``nbytes`` of the NVME tier (4 KiB-padded) for bytes outside any handle.

        Runs on the caller's thread and does no I/O, so a budget too small fails where the
        caller can name it. Free the extent with :meth:`free_extent` once it is read back.

        Args:
            key: a name for the extent (in errors and the swap file's journal).
            nbytes: bytes to hold.
            what: what the bytes are, for the error (default: ``key``).
            advice: what the user should do when it does not fit (default: the store's).

        Returns:
            The :class:`Extent` (``length``: the padded size a buffer for it must have).

        Raises:
            BudgetError: no NVME tier (no swap dir), or it has no room: one line naming the
                budget, ``what``, the bytes requested and held, and ``advice``.
        """
        ext = self.nvme.alloc(key, nbytes) if self.nvme is not None else None
        if ext is None:
            raise self.space.budget_error(Tier.NVME, key, nbytes, what=what, advice=advice)
        return ext

    def write_extent(self, ext: Extent, src: torch.Tensor) -> Future:
        """Write ``src`` (uint8 ``[ext.length]``, 4 KiB-aligned CPU memory) to the extent, on
        the store's I/O threads; ``src`` must not change until the Future is done.

        Returns:
            A Future (result: ``ext``), done once the bytes and their checksum are on disk
            and counted as HOST -> NVME traffic; it fails with ``SwapDirError`` (a full disk,
            an I/O error), and then nothing is counted.
        """
        return self._extent_transfer(self.nvme.write(ext, src), ext, Tier.HOST, Tier.NVME, ext)

    def read_extent(self, ext: Extent, dst: torch.Tensor) -> Future:
        """Read the extent into ``dst`` (uint8 ``[ext.length]``, aligned) and verify its checksum.

        Returns:
            A Future (result: ``dst``), done once the bytes are there and counted as
            NVME -> HOST traffic; it fails with ``IntegrityError`` (corrupt or truncated).

        Raises:
            IntegrityError: the extent was never written.
        """
        return self._extent_transfer(self.nvme.read(ext, dst), ext, Tier.NVME, Tier.HOST, dst)

    def free_extent(self, ext: Extent) -> None:
        """Give the extent's space back to the NVME tier (no transfer may be using it)."""
        self.nvme.free(ext)

    def _extent_transfer(self, io: Future, ext: Extent, src: Tier, dst: Tier, result: object) -> Future:
        def count(_) -> object:  # on the I/O thread that finished it, before any waiter wakes
            self.traffic.moved(src, dst, ext.length)
            return result
        done = then(io, count)
        with self._extent_lock:
            self._extent_io.add(done)
        done.add_done_callback(self._extent_done)
        return done

    def _extent_done(self, f: Future) -> None:
        with self._extent_lock:
            self._extent_io.discard(f)

    def _extents_in_flight(self) -> list[Future]:
        with self._extent_lock:
            return [f for f in self._extent_io if not f.done()]
