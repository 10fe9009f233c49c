"""Page-aligned host memory: what O_DIRECT I/O needs of its buffers, offsets and lengths, and
what pinned HOST slabs are built on (``device.pinned_empty`` registers one with the GPU).
Plain RAM, no device call: the store's arenas, NVMe and direct I/O size everything with it."""
from __future__ import annotations

import mmap

import torch

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses (4 KiB covers every NVMe LBA size in use)


def align_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int, populate: bool = True) -> torch.Tensor:
    """A page-aligned uint8 host buffer (not pinned) of ``align_up(nbytes)`` bytes.

    Args:
        nbytes: requested size; rounded up to a multiple of 4 KiB.
        populate: touch every page now, so the memory is physically resident
            (the budget it stands for is real, and the first I/O does not
            page-fault).

    Returns:
        A 1-D ``torch.uint8`` tensor ``[align_up(nbytes)]`` whose storage is an
        anonymous ``mmap`` (freed when the last view is gone).
    """
    if nbytes <= 0:
        raise ValueError(f"aligned_empty: nbytes={nbytes} must be > 0")
    size = align_up(nbytes)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive through the buffer protocol
    if populate:
        t.zero_()
    return t
