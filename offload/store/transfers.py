"""How bytes move between tiers: the copy state machine under :class:`TieredStore`.

A copy of a handle in a tier goes ``ABSENT -> IN_FLIGHT -> RESIDENT`` (or ``DIRTY``
when it starts as zeros): :meth:`Transfers.ensure` allocates its slot and starts the
copy from the best settled source (``TensorHandle.source_for``); the copy lands on an
I/O or copy thread, which settles the state under the store's lock. Every transfer is
listed in its source copy's ``outgoing`` until done, so no slot is freed under a
running read, and its bytes are counted per link (``traffic.py``).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from ._futures import completed
from ..aligned import align_up
from ..device import Device
from .handle import Residency, TensorHandle, Tier
from .tiers import TierSpace
from .traffic import TierTraffic

HELD = (Residency.RESIDENT, Residency.DIRTY)


class Transfers:
    """Start, count and settle the copies of handles between tiers (the store's lock guards them).

    Args:
        space: the tiers' bytes (arenas, swap file).
        device: the compute device (its copy engine).
        traffic: the per-link byte counters.
        lock: the store's lock.
    """

    def __init__(self, space: TierSpace, device: Device, traffic: TierTraffic, lock: threading.RLock):
        self.space, self.device, self.traffic, self.lock = space, device, traffic, lock
        self.nvme = space.nvme

    def free_slot(self, tier: Tier, h: TensorHandle) -> None:
        c = h.copies[tier]
        assert all(f.done() for f in c.outgoing), f"freeing {h.key!r} in {tier.name} while a transfer reads it"
        if c.slot is not None:
            if tier is Tier.HOST:
                self.device.note_host_free(self.bytes_of(tier, h))
            self.space.free(tier, c.slot)
            if tier is Tier.DEVICE:
                self.device.note_free()  # a copy into these bytes waits for their queued readers
        c.slot, c.residency, c.future, c.writing = None, Residency.ABSENT, None, None

    def bytes_of(self, tier: Tier, h: TensorHandle) -> torch.Tensor:
        return self.space.bytes_of(tier, h.copies[tier].slot)

    def ensure(self, h: TensorHandle, tier: Tier) -> Future:
        """Start (or find) the transfer that makes ``tier``'s copy valid (allocating its slot). Lock held."""
        c = h.copies[tier]
        if c.residency in HELD:
            return completed(None)
        if c.residency is Residency.IN_FLIGHT:
            return c.future
        c.slot = self.space.alloc(tier, h.key, h.nbytes)
        fut = c.future = Future()
        c.residency = Residency.IN_FLIGHT
        fut.set_running_or_notify_cancel()
        self._pull(h, tier)  # a transfer failing at once aborts (and clears c.future) inside
        return fut

    def _pull(self, h: TensorHandle, tier: Tier, staged: bool = False) -> None:
        """Copy into ``tier``'s allocated slot from the best settled source. Completes its Future.

        On an accelerator a disk -> device fetch first stages a HOST copy (pinned: the
        device's DMA reads it) and runs again when that landed (``staged``), re-choosing the
        source under the lock at that moment; the staging copy is freed once the device copy
        has landed, so the HOST tier holds only what is in flight.
        """
        with self.lock:
            c = h.copies[tier]
            if c.residency is not Residency.IN_FLIGHT:
                return  # aborted meanwhile
            try:
                src = h.source_for(tier)
                if src is None:  # never written: the value is zeros, and this copy is the newest
                    self.bytes_of(tier, h).zero_()
                    c.residency = Residency.DIRTY
                    c.future.set_result(None)
                    return
                if src is Tier.NVME and tier is Tier.DEVICE and self.device.is_accelerator:
                    self.ensure(h, Tier.HOST).add_done_callback(lambda f: self._pull(h, tier, staged=True))
                    return
                f = self.copy(h, src, tier)
            except BaseException as e:  # noqa: BLE001 - the fetch's waiter gets it
                self._abort(h, tier, e)
                return
        f.add_done_callback(lambda f: self._landed(h, tier, f.exception(), staged and src is Tier.HOST))

    def copy(self, h: TensorHandle, src: Tier, dst: Tier, durable: bool = False) -> Future:
        """Move the bytes of ``h`` from ``src`` to ``dst`` (both slots allocated). Lock held.

        The transfer is listed in the source copy's ``outgoing`` until it is
        done: an eviction waits for it before the source's bytes are reused.
        """
        sc = h.copies[src]
        if src is Tier.NVME:
            f = self.nvme.read(sc.slot, self.bytes_of(dst, h))
        elif dst is Tier.NVME:
            f = self.nvme.write(h.copies[dst].slot, self.bytes_of(src, h), durable=durable)
        else:
            f = self.device.copy_async(self.bytes_of(dst, h), self.bytes_of(src, h))
        sc.outgoing.append(f)
        n = align_up(max(h.nbytes, 1))

        def count(done: Future) -> None:
            with self.lock:
                sc.outgoing.remove(done)
            if done.exception() is None:
                self.traffic.moved(src, dst, n)
        f.add_done_callback(count)
        return f

    def _landed(self, h: TensorHandle, tier: Tier, exc: BaseException | None, staged: bool = False) -> None:
        with self.lock:
            c = h.copies[tier]
            if staged:  # before the fetch's waiters wake: a landed copy holds no HOST staging
                self.drop_staging(h)
            if exc is not None:
                self._abort(h, tier, exc)
            elif c.residency is Residency.IN_FLIGHT:
                c.residency = Residency.RESIDENT
                c.future.set_result(None)

    def drop_staging(self, h: TensorHandle) -> None:
        """Free ``h``'s HOST copy if it only staged a disk <-> device copy: not the home, no
        consumer holds it, nothing reads it, and it is no newer than the home. Lock held."""
        c = h.copies[Tier.HOST]
        if (h.home is not Tier.HOST and c.residency is Residency.RESIDENT and not c.pins
                and all(f.done() for f in c.outgoing)):
            self.free_slot(Tier.HOST, h)

    def _abort(self, h: TensorHandle, tier: Tier, exc: BaseException) -> None:
        """A transfer into ``tier`` failed: free the slot, drop its pins, fail its Future. Lock held."""
        c = h.copies[tier]
        fut = c.future
        c.pins = 0
        self.free_slot(tier, h)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

