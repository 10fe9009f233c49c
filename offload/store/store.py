"""The tiered store: handles, byte budgets, and asynchronous moves between tiers (docs/architecture.md §3).

One :class:`TieredStore` owns every swappable tensor of a run as a
:class:`TensorHandle`. Each handle has an authoritative copy in its *home* tier
(NVME or HOST) and may have working copies in faster tiers:

- ``fetch(h, tier)`` starts bringing the newest copy into ``tier`` and pins it;
  ``wait``/``Future.result()`` gives a tensor *view* into the tier's arena.
- ``mark_dirty(h, tier)`` says the consumer changed that copy;
  ``write_back(h)`` copies it to the home tier asynchronously.
- ``release(h, tier)`` unpins; ``evict(h, tier)`` frees an unpinned copy
  (writing it back first if it is dirty).

Budgets are enforced at allocation: a tier's arena (or the NVMe file) cannot
hand out more than its budget, and a request that does not fit raises
:class:`BudgetError` naming the tier, budget, bytes held and the request. The
store never evicts on its own: the caller (the unit memory) knows the future
access order and chooses what to evict.

Thread model: public methods run on the caller's thread and never block on
I/O (except ``register`` with data, ``load`` and ``close``). Transfers
complete on I/O / copy threads, which update handle state under one lock.

The bytes themselves (arenas, swap file, budgets) are a :class:`TierSpace` (``tiers.py``);
the copies between tiers are :class:`Transfers` (``transfers.py``); the per-tier traffic
counters are a :class:`TierTraffic` (``traffic.py``). Bytes with no handle (offloaded
activations) use its anonymous extents (``alloc_extent`` / ``write_extent`` /
``read_extent`` / ``free_extent``, ``extents.py``): budgeted and counted the same way.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ...events import TierStats
from ._futures import completed, then
from ..aligned import return_freed_tensors
from ..device import Device
from .directio import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH
from .extents import AnonymousExtents
from .handle import Residency, TensorHandle, Tier
from .nvme import NvmeBackend
from .swapdir import SwapDir
from .tiers import TierSpace
from .traffic import TierTraffic
from .transfers import HELD, Transfers


class TieredStore(AnonymousExtents):
    """Byte-budgeted DEVICE / HOST / NVME tiers holding :class:`TensorHandle` s.

    Args:
        device_bytes: DEVICE budget (CUDA memory, or a RAM arena on CPU).
        host_bytes: HOST budget (pinned RAM on CUDA).
        nvme_bytes: NVME budget, preallocated in the swap dir now; ``None`` =
            grow on demand.
        nvme_reserve: with ``nvme_bytes=None``, what the NVME tier will hold (the plan's
            figure), preallocated now, so a disk too small is refused before training.
        swap_dir: the swap directory (required for handles whose home is NVME).
        device: a :class:`Device`, ``"cuda"``/``"cpu"``, or None (CUDA if available).
        queue_depth: NVMe syscalls in flight.
        chunk_bytes: largest single NVMe syscall.
        slab_bytes: DEVICE/HOST slab size (default: one slab per tier).
        direct: use ``O_DIRECT`` where the file system allows it.

    Raises:
        BudgetError: a negative budget.
        SwapDirError: the swap dir cannot be used.
        DiskFullError: the swap dir's disk is too small for ``nvme_bytes`` / ``nvme_reserve``.
    """

    def __init__(self, device_bytes: int, host_bytes: int, nvme_bytes: int | None = None,
                 swap_dir: str | Path | SwapDir | None = None, device: Device | str | None = None,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 slab_bytes: int | None = None, direct: bool = True, nvme_reserve: int = 0):
        self.device = device if isinstance(device, Device) else Device(device)
        return_freed_tensors()  # a step's freed activations must not stay resident (aligned.py)
        try:
            self.space = TierSpace(self.device, device_bytes, host_bytes, nvme_bytes, swap_dir,
                                   queue_depth=queue_depth, chunk_bytes=chunk_bytes,
                                   slab_bytes=slab_bytes, direct=direct)
        except BaseException:
            self.device.close()
            raise
        self._lock = threading.RLock()  # guards every handle's state
        self._handles: dict[str, TensorHandle] = {}
        self.traffic = TierTraffic()
        self.moves = Transfers(self.space, self.device, self.traffic, self._lock)
        self._init_extents()
        self.stall_s = 0.0  # time consumers waited in wait() for transfers not yet done
        self.nvme: NvmeBackend | None = self.space.nvme  # None without a swap dir
        self.swap: SwapDir | None = self.space.swap
        if self.nvme is not None and nvme_reserve:
            try:
                self.nvme.reserve(nvme_reserve)
            except BaseException:  # leave no swap dir behind
                self.close()
                raise

    # -- budgets -----------------------------------------------------------------
    def budget(self, tier: Tier) -> int | None:
        """The tier's budget in bytes (None: NVME without a bound; 0: tier unused)."""
        return self.space.budget(tier)

    def held(self, tier: Tier) -> int:
        """Bytes the tier has handed out now (block sizes, 4 KiB padding included)."""
        return self.space.held(tier)

    def has_tier(self, tier: Tier | str) -> bool:
        """Whether ``tier`` can hold anything: NVME with a swap dir, DEVICE / HOST with a budget."""
        tier = Tier.parse(tier)
        return self.nvme is not None if tier is Tier.NVME else bool(self.budget(tier))

    # -- registration ----------------------------------------------------------
    def register(self, key: str, shape: Iterable[int] | None = None, dtype: torch.dtype | None = None,
                 home: Tier | str = Tier.NVME, data: torch.Tensor | None = None) -> TensorHandle:
        """Add a tensor to the store; its authoritative copy lives in ``home``.

        Args:
            key: unique name.
            shape, dtype: the layout (taken from ``data`` when given).
            home: ``Tier.NVME`` or ``Tier.HOST``.
            data: initial value, any CPU tensor; written to ``home`` before returning.
                Without it the tensor starts as zeros (no I/O until first written back).

        Returns:
            The handle.

        Raises:
            BudgetError: ``home`` cannot hold the tensor.
            ValueError: duplicate key, bad home, or ``data`` not matching shape/dtype.
        """
        h = TensorHandle.new(key, shape, dtype, home, data)
        home = h.home
        with self._lock:
            if key in self._handles:
                raise ValueError(f"a tensor named {key!r} is already registered")
            h.copies[home].slot = self.space.alloc(home, key, h.nbytes)
            self._handles[key] = h
        if home is Tier.HOST or data is not None:  # an NVMe tensor without data stays unwritten
            self.traffic.wrote(home, self.space.write_initial(home, h.copies[home].slot, data))
            h.copies[home].residency = Residency.RESIDENT
        return h

    def unregister(self, h: TensorHandle) -> None:
        """Free every copy of ``h`` (none may be pinned; transfers in flight are awaited)."""
        for t in (Tier.DEVICE, Tier.HOST):
            if t is not h.home:
                self.evict(h, t, write_back=False).result()
        with self._lock:
            self.moves.free_slot(h.home, h)
            del self._handles[h.key]

    @property
    def handles(self) -> list[TensorHandle]:
        """All registered handles."""
        return list(self._handles.values())

    # -- moving data -----------------------------------------------------------
    def fetch(self, h: TensorHandle, tier: Tier | str) -> Future:
        """Bring the newest copy of ``h`` into ``tier`` and pin it there.

        Args:
            h: the handle.
            tier: ``Tier.DEVICE`` or ``Tier.HOST``.

        Returns:
            A Future whose result is the tensor view ``[h.shape]`` in that tier.
            Each fetch pins once; call :meth:`release` once per fetch.

        Raises:
            BudgetError: the tier has no room for ``h`` now.
        """
        tier = Tier.parse(tier)
        if tier is Tier.NVME:
            raise ValueError(f"fetch({h.key!r}, NVME): data reaches NVME through write_back")
        with self._lock:
            f = self.moves.ensure(h, tier)
            h.copies[tier].pins += 1
        return then(f, lambda _: self.view(h, tier))

    def wait(self, h: TensorHandle, tier: Tier | str) -> torch.Tensor:
        """Block until ``h`` is valid in ``tier`` (it must have been fetched) and return its view."""
        tier = Tier.parse(tier)
        with self._lock:
            f = h.copies[tier].future if h.copies[tier].residency is Residency.IN_FLIGHT else None
        if f is not None:
            self.result(f)
        return self.view(h, tier)

    def result(self, f: Future) -> Any:
        """``f.result()`` for a transfer of this store; the time blocked is added to
        :attr:`stall_s` — the one count of how long compute waited on I/O."""
        if not f.done():
            t0 = time.perf_counter()
            try:
                f.result()
            finally:
                with self._lock:
                    self.stall_s += time.perf_counter() - t0
        return f.result()  # raises the transfer's error

    def wait_unread(self, h: TensorHandle, tier: Tier | str) -> None:
        """Block until no transfer reads ``tier``'s copy of ``h`` (its write-back included),
        so it may change in place; the time blocked counts as stall."""
        tier = Tier.parse(tier)
        while True:
            with self._lock:
                c = h.copies[tier]
                busy = [f for f in (c.writing, *c.outgoing) if f is not None and not f.done()]
            if not busy:
                return
            self.result(busy[0])

    def view(self, h: TensorHandle, tier: Tier | str) -> torch.Tensor:
        """The tensor ``[h.shape]`` in ``tier``'s arena (no copy). The copy must be resident."""
        tier = Tier.parse(tier)
        c = h.copies[tier]
        if tier is Tier.NVME or c.residency not in HELD:
            raise ValueError(f"{h.key!r} is {c.residency.value} in {tier.name}; fetch and wait first")
        return self.view_of(h, tier)

    def view_of(self, h: TensorHandle, tier: Tier) -> torch.Tensor:
        return self.space.view(tier, h.copies[tier].slot, h.shape, h.dtype)

    def release(self, h: TensorHandle, tier: Tier | str) -> None:
        """Drop one pin taken by :meth:`fetch`; an unpinned copy may be evicted."""
        tier = Tier.parse(tier)
        with self._lock:
            c = h.copies[tier]
            if c.pins <= 0 and not c.valid:
                return  # its fetch failed and already dropped the pin
            if c.pins <= 0:
                raise ValueError(f"release({h.key!r}, {tier.name}) without a matching fetch")
            c.pins -= 1

    def mark_dirty(self, h: TensorHandle, tier: Tier | str) -> None:
        """Record that the copy in ``tier`` was changed in place (it becomes the newest).

        Other working copies are now stale and are freed.

        Raises:
            ValueError: the copy is not resident, or a stale copy is pinned or in use by a transfer.
        """
        tier = Tier.parse(tier)
        with self._lock:
            c = h.copies[tier]
            if c.residency not in HELD:
                raise ValueError(f"mark_dirty({h.key!r}, {tier.name}): the copy is {c.residency.value}")
            stale = [t for t, o in h.copies.items() if t not in (tier, h.home) and o.valid]
            for t in stale:
                o = h.copies[t]
                if o.pins or o.residency is Residency.IN_FLIGHT or any(not f.done() for f in o.outgoing):
                    raise ValueError(f"mark_dirty({h.key!r}, {tier.name}): its {t.name} copy would go "
                                     "stale while pinned or in use by a transfer; release/wait for it first")
            for t in stale:
                self.moves.free_slot(t, h)
            if tier is not h.home:
                c.residency = Residency.DIRTY
            c.generation += 1

    def write_back(self, h: TensorHandle, durable: bool = False) -> Future:
        """Copy the dirty copy of ``h`` to its home tier, asynchronously.

        The dirty copy must not change until the Future completes; it then is
        RESIDENT (clean). With ``durable=True`` the NVMe write is ``fdatasync``-ed.

        Returns:
            A Future (result None); done at once when nothing is dirty.

        Raises:
            BudgetError: on CUDA, no HOST room to stage a DEVICE -> NVME write.
        """
        with self._lock:
            d = h.dirty_tier
            if d is None:
                return completed(None)
            c = h.copies[d]
            if c.writing is not None and not c.writing.done():
                return c.writing
            gen = c.generation
            if h.home is Tier.NVME and d is Tier.DEVICE and self.device.is_accelerator:
                # device -> disk is staged in pinned HOST memory, freed once the disk has it
                staged = self.moves.ensure(h, Tier.HOST)  # source: the dirty DEVICE copy

                def to_disk(_):
                    with self._lock:
                        return self.moves.copy(h, Tier.HOST, h.home, durable)
                f = then(staged, to_disk)
            else:
                f = self.moves.copy(h, d, h.home, durable)

            def clean(_):
                with self._lock:
                    if c.generation == gen and c.residency is Residency.DIRTY:
                        c.residency = Residency.RESIDENT
                    h.copies[h.home].residency = Residency.RESIDENT
                    if d is Tier.DEVICE:
                        self.moves.drop_staging(h)
            c.writing = then(f, clean)
            return c.writing

    def evict(self, h: TensorHandle, tier: Tier | str, write_back: bool = True) -> Future:
        """Free the copy of ``h`` in ``tier`` once no transfer needs it.

        Args:
            h: the handle.
            tier: DEVICE or HOST (never the home tier).
            write_back: a dirty copy is written back first; False drops the change.

        Returns:
            A Future that completes when the bytes are free (or the copy was
            pinned again meanwhile, and stays). A failed write-back fails it and
            keeps the dirty copy.

        Raises:
            ValueError: ``tier`` is the home tier, or the copy is pinned.
        """
        tier = Tier.parse(tier)
        with self._lock:
            c = h.copies[tier]
            if tier is h.home:
                raise ValueError(f"evict({h.key!r}, {tier.name}): the home copy is never evicted")
            if c.pins:
                raise ValueError(f"evict({h.key!r}, {tier.name}): pinned by {c.pins} fetch(es); release first")
            if not c.valid:
                return completed(None)
            done: Future = Future()
            done.set_running_or_notify_cancel()

            def try_free(prev: Future | None = None) -> None:
                while True:  # a loop, not recursion: the awaited Future may already be done
                    if prev is not None and prev.exception() is not None and prev is c.writing:
                        done.set_exception(prev.exception())  # keep the dirty copy
                        return
                    with self._lock:
                        reading = [f for f in c.outgoing if not f.done()]
                        if c.pins or not c.valid:
                            nxt = None
                        elif c.residency is Residency.DIRTY and write_back:
                            nxt = self.write_back(h)
                        elif reading:  # a transfer still reads these bytes
                            nxt = reading[0]
                        elif c.residency is Residency.IN_FLIGHT:
                            nxt = c.future
                        else:
                            self.moves.free_slot(tier, h)
                            nxt = None
                    if nxt is None:
                        done.set_result(None)
                        return
                    if not nxt.done():
                        nxt.add_done_callback(try_free)
                        return
                    prev = nxt
            try_free()
            return done

    def load(self, h: TensorHandle) -> torch.Tensor:
        """A fresh CPU tensor with the newest value of ``h`` (blocks; for checkpoints and tests)."""
        with self._lock:
            src = h.newest()
            f = h.copies[src].future if src is not None else None
        if f is not None:
            f.result()
        if src is None:
            return torch.zeros(h.shape, dtype=h.dtype)
        if src is Tier.NVME:
            return self.space.read_new(h.copies[Tier.NVME].slot, h.nbytes, h.shape, h.dtype)
        return self.view(h, src).to("cpu", copy=True)

    def discard_free(self, tier: Tier | str) -> int:
        """Give the free pages of a RAM tier's arena back to the OS (0 where the arena is
        pinned or device memory: CUDA). For a window that sits empty through part of a
        step, so the process's peak RSS is not paid for memory that does nothing then.

        Returns:
            Bytes discarded.
        """
        tier = Tier.parse(tier)
        if tier is Tier.NVME or self.device.is_accelerator:
            return 0
        with self._lock:  # no block is allocated or freed while the free list is walked
            return self.space.arenas[tier].discard_free()

    # -- statistics ------------------------------------------------------------
    def tier_stats(self, window: bool = False) -> dict[str, TierStats]:
        """Occupancy and traffic per tier, keyed ``"DEVICE"``, ``"HOST"``, ``"NVME"`` (see ``traffic.py``).

        Args:
            window: also fill ``read_gbps``/``write_gbps`` over the time since the
                previous windowed call (and start a new window).
        """
        return self.traffic.stats(self.held, self.budget, window=window)

    def synchronize(self) -> None:
        """Wait for every transfer and write-back in flight (anonymous extents' included)."""
        while True:
            with self._lock:
                pending = [f for h in self._handles.values() for c in h.copies.values()
                           for f in (c.future, c.writing, *c.outgoing) if f is not None and not f.done()]
            pending += self._extents_in_flight()
            if not pending:
                return
            for f in pending:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - the waiter of that transfer sees it
                    pass

    def close(self) -> None:
        """Wait for transfers, then release the arenas, the swap file and the swap dir."""
        self.synchronize()
        self.space.close()
        self.device.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
