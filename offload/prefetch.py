"""Prefetching along a known access order (ARCHITECTURE.md §3).

The order in which a training step touches its tensors is static (forward
blocks 0…L−1, backward L−1…0, an update per block), so transfers are *planned*,
not demand-paged. :class:`PrefetchQueue` keeps up to ``depth`` upcoming
tensors in flight to (or resident in) a tier, and when the tier is full it
evicts the unpinned tensor whose next use is farthest away (Belady's rule,
exact here because the future is known). It never evicts a tensor that is
needed sooner than the one it would make room for.

    pq = PrefetchQueue(store, order, tier=Tier.DEVICE, depth=2)
    for h in order:
        w = pq.get(h)              # waits only if the transfer is late (stall)
        ...compute with w...
        pq.done(h, dirty=True)     # write back asynchronously, unpin

``stall_s`` is the time ``get`` waited: the share of the step lost to I/O.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from typing import Sequence

import torch

from ..errors import BudgetError
from .handle import Residency, TensorHandle, Tier
from .store import TieredStore


class PrefetchQueue:
    """Fetches ``order`` into ``tier`` ahead of its consumer.

    Args:
        store: the tiered store.
        order: the access order (a handle may appear many times).
        tier: where the consumer computes (DEVICE or HOST).
        depth: how many positions ahead of the consumer to keep fetched.
        cyclic: the order repeats (step after step): look ahead across the end.

    Raises:
        ValueError: empty order, depth < 0, or tier NVME.
    """

    def __init__(self, store: TieredStore, order: Sequence[TensorHandle], tier: Tier | str = Tier.DEVICE,
                 depth: int = 2, cyclic: bool = False):
        tier = Tier.parse(tier)
        if not order:
            raise ValueError("PrefetchQueue needs a non-empty access order")
        if depth < 0:
            raise ValueError(f"depth={depth} must be >= 0")
        if tier is Tier.NVME:
            raise ValueError("PrefetchQueue fetches into DEVICE or HOST, not NVME")
        self.store, self.order, self.tier, self.depth, self.cyclic = store, list(order), tier, depth, cyclic
        n = len(self.order)
        first: dict[str, int] = {}
        self._nxt = [math.inf] * n  # position of the same handle's next use, within one pass
        for i in reversed(range(n)):
            k = self.order[i].key
            self._nxt[i] = first.get(k, math.inf)
            first[k] = i
        if cyclic:
            self._nxt = [first[self.order[i].key] + n if x == math.inf else x for i, x in enumerate(self._nxt)]
        self._unique = list({h.key: h for h in self.order}.values())
        self._next_use = dict(first)  # key -> next absolute position it is needed at
        self.pos = 0  # next position the consumer will get
        self.issued = 0  # next position to fetch
        self._evicting: list[Future] = []
        self.stall_s = 0.0

    def _at(self, p: int) -> TensorHandle:
        return self.order[p % len(self.order)]

    def _end(self) -> float:
        return math.inf if self.cyclic else len(self.order)

    def _victim(self, before: int) -> TensorHandle | None:
        """The unpinned resident handle with the farthest next use, if that is after ``before``."""
        best, best_use = None, before
        for h in self._unique:
            c = h.copies[self.tier]
            if c.pins or c.residency not in (Residency.RESIDENT, Residency.DIRTY) or self.tier is h.home:
                continue
            use = self._next_use.get(h.key, math.inf)
            if use > best_use:
                best, best_use = h, use
        return best

    def _pump(self) -> None:
        """Issue fetches up to ``depth`` ahead, evicting by future use when the tier is full."""
        self._evicting = [f for f in self._evicting if not f.done()]
        while self.issued < min(self.pos + self.depth + 1, self._end()):
            h = self._at(self.issued)
            try:
                self.store.fetch(h, self.tier)
            except BudgetError:
                victim = self._victim(before=self.issued)
                if victim is None or self._evicting:
                    return  # retry when the consumer moves on or an eviction lands
                self._evicting.append(self.store.evict(victim, self.tier))
                continue
            self.issued += 1

    def get(self, h: TensorHandle | None = None) -> torch.Tensor:
        """The next tensor of the order, resident in the tier (waits if it is not there yet).

        Args:
            h: the handle the caller expects (checked against the order), or None.

        Returns:
            The view ``[h.shape]``; valid until :meth:`done`.

        Raises:
            ValueError: ``h`` is not the next handle of the order, or the order is exhausted.
            BudgetError: the tier cannot hold the tensor even after evicting everything evictable.
        """
        if self.pos >= self._end():
            raise ValueError(f"access order exhausted after {self.pos} gets")
        want = self._at(self.pos)
        if h is not None and h is not want:
            raise ValueError(f"access order mismatch at position {self.pos}: "
                             f"expected {want.key!r}, got {h.key!r}")
        self._pump()
        t0 = time.perf_counter()  # from here on the consumer is blocked: that is the stall
        while self.issued <= self.pos:  # not even issued: wait for room, else fail
            pending = [f for f in self._evicting if not f.done()]
            if pending:
                pending[0].result()  # the consumer needs the room now
            elif self._victim(before=self.pos) is None:
                self.store.fetch(want, self.tier)  # raises BudgetError naming the tier
                self.issued += 1
                break
            self._pump()
        out = self.store.wait(want, self.tier)
        self.stall_s += time.perf_counter() - t0
        p = self.pos
        self._next_use[want.key] = (p // len(self.order)) * len(self.order) + self._nxt[p % len(self.order)]
        self.pos += 1
        return out

    def done(self, h: TensorHandle, dirty: bool = False, durable: bool = False) -> Future | None:
        """The consumer is finished with ``h`` (the last :meth:`get`).

        Args:
            h: the handle.
            dirty: the consumer changed it: write it back asynchronously.
            durable: make that write durable (fdatasync).

        Returns:
            The write-back Future when ``dirty``, else None.
        """
        fut = None
        if dirty:
            self.store.mark_dirty(h, self.tier)
            fut = self.store.write_back(h, durable=durable)
        self.store.release(h, self.tier)
        self._pump()
        return fut

    def close(self, evict: bool = True) -> None:
        """Wait for write-backs; drop the prefetched-but-unused pins; optionally empty the tier."""
        for p in range(self.pos, self.issued):
            self.store.release(self._at(p), self.tier)
        self.issued = self.pos
        self.store.synchronize()
        if evict:
            for h in self._unique:
                if h.home is not self.tier and not h.copies[self.tier].pins:
                    self.store.evict(h, self.tier).result()
