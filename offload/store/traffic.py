"""Traffic accounting of a :class:`~outcore.offload.store.store.TieredStore`: bytes per tier link.

Every completed transfer adds its (4 KiB-padded) size to the source tier's
``read`` and the destination tier's ``written`` counters. :meth:`TierTraffic.stats`
turns the counters and the store's occupancy into one
:class:`~outcore.events.TierStats` per tier — what a ``StepEvent`` carries to the
dashboard — with bandwidths over the window since the previous windowed call.

Counters only ever grow; a failed transfer is not counted (no bytes arrived).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...events import TierStats
from .handle import Tier


class _Counters:
    """Bytes moved into and out of one tier, and a snapshot for bandwidth windows."""

    def __init__(self) -> None:
        self.read = self.written = 0
        self.mark = (0, 0, time.perf_counter())  # (read, written, time) at the window's start


class TierTraffic:
    """Per-tier byte counters, safe to update from I/O and copy threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers = {t: _Counters() for t in Tier}

    def moved(self, src: Tier, dst: Tier, nbytes: int) -> None:
        """Count a completed transfer of ``nbytes`` from ``src`` to ``dst``."""
        with self._lock:
            self._tiers[src].read += nbytes
            self._tiers[dst].written += nbytes

    def wrote(self, tier: Tier, nbytes: int) -> None:
        """Count ``nbytes`` written into ``tier`` from outside the store (e.g. initial data)."""
        with self._lock:
            self._tiers[tier].written += nbytes

    def totals(self, tier: Tier) -> tuple[int, int]:
        """(bytes read from, bytes written to) ``tier`` so far."""
        with self._lock:
            c = self._tiers[tier]
            return c.read, c.written

    def stats(self, held: Callable[[Tier], int], budget: Callable[[Tier], int | None],
              window: bool = False) -> dict[str, TierStats]:
        """Occupancy and traffic per tier, keyed ``"DEVICE"``, ``"HOST"``, ``"NVME"``.

        Args:
            held: bytes the tier holds now (the store's ``held``).
            budget: the tier's budget (None or 0: unbounded / unused; reported as 0).
            window: also fill ``read_gbps`` / ``write_gbps`` over the time since the
                previous windowed call (and start a new window).

        Returns:
            tier name -> :class:`TierStats`.
        """
        out, now = {}, time.perf_counter()
        with self._lock:
            for t in Tier:
                c = self._tiers[t]
                s = TierStats(held_bytes=held(t), budget_bytes=budget(t) or 0,
                              read_bytes=c.read, written_bytes=c.written)
                if window:
                    r0, w0, t0 = c.mark
                    dt = max(now - t0, 1e-9)
                    s.read_gbps, s.write_gbps = (c.read - r0) / dt / 1e9, (c.written - w0) / dt / 1e9
                    c.mark = (c.read, c.written, now)
                out[t.name] = s
        return out
