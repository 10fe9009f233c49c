"""Reusable buffers of the update: the fp32 copies of 16-bit gradients a mixed-precision update
reads (:class:`WidenedGrads`), and the pinned HOST copies an update on the host moves through
(:class:`HostStaging`).

The update of a unit in bf16 / fp16 runs on its fp32 master weights with its gradients
widened to fp32 (``update.py``). ``g.to(float32)`` would allocate a fresh tensor the size
of the unit's gradients at every update; a buffer that large is ``mmap``-ed by the
allocator and given back on free, so every update page-faults it in again (the kernel
zeroes each page first): measured on a 2-core CPU, widening a 67M-element block's
gradients took 0.6-1.2 s that way against 0.1-0.2 s into a buffer kept across units.
The widening is exact, so the update's bits are the same either way.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..device import pinned_empty

#: each gradient's copy starts at a multiple of this many elements (64 bytes of fp32), as a
#: fresh allocation would: vector kernels see the alignment they would otherwise get
ALIGN_ELEMENTS = 16


class WidenedGrads:
    """Widen gradients into one buffer, grown to the largest update seen and reused after."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def __call__(self, grads: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """``[g.to(dtype) for g in grads]``, as views of the kept buffer (valid until the next call).

        Args:
            grads: the 16-bit gradients (on the device the update runs on).
            dtype: the masters' dtype (fp32).

        Returns:
            One tensor per gradient, its shape, ``dtype``, holding the same values.
        """
        starts, at = [], 0
        for g in grads:
            starts.append(at)
            at += -(-g.numel() // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        device = grads[0].device if grads else torch.device("cpu")
        if (self._buffer is None or self._buffer.numel() < at or self._buffer.dtype != dtype
                or self._buffer.device != device):
            self._buffer = torch.empty(at, dtype=dtype, device=device)
        out = []
        for g, s in zip(grads, starts):
            wide = self._buffer[s:s + g.numel()].view(g.shape)
            wide.copy_(g)
            out.append(wide)
        return out


class HostStaging:
    """Pinned HOST buffers, one per use (``slot``), that an update on the host copies a unit's
    gradients down and its new weights up through: a copy from pageable memory crosses PCIe at
    about half the rate (CUDA stages it through its own pinned buffer), and pinning a fresh
    buffer per unit costs more than the copy. Grown to the largest unit seen, reused after.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def views(self, slot: str, like: list[torch.Tensor], dtype: torch.dtype | None = None,
              before_growing: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """One HOST tensor per tensor of ``like`` (its shape; ``dtype``, else its dtype), views of
        ``slot``'s pinned buffer, each 64-byte aligned (valid until ``slot``'s next call).
        ``before_growing()`` runs before a buffer too small is freed: a queued copy may still
        read it."""
        sizes = [t.numel() * (dtype or t.dtype).itemsize for t in like]
        starts, at = [], 0
        for n in sizes:
            starts.append(at)
            at += -(-n // 64) * 64
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < at:
            if buf is not None and before_growing is not None:
                before_growing()
            self._buffers[slot] = None  # (the old buffer's pages go before the new one is pinned)
            buf = self._buffers[slot] = pinned_empty(self.device, max(at, 64))
        return [buf[s:s + n].view(dtype or t.dtype).view(t.shape) for t, s, n in zip(like, starts, sizes)]
