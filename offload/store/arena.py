"""Arenas: a tier's working memory carved from a few preallocated slabs (docs/architecture.md §3).

Tensors are not allocated one by one: a tier owns slabs whose sizes add up to
its budget, and hands out 4 KiB-aligned blocks from them with a first-fit
free list that coalesces neighbours. Allocation costs no syscalls, the budget
is physical memory (slabs are touched when created), and every block is
aligned for ``O_DIRECT``.

Large blocks are taken from the top of a slab, small ones from the bottom
(two-ended allocation): a unit far larger than the others (an embedding and
its optimizer state) then never lands between small blocks, whose coming and
going would otherwise split the free space into holes too small for the next
large request although the bytes are there (measured: a HOST window sized for
the embedding's two moments plus three blocks failed this way first-fit).

:class:`FreeList` is the allocator alone (offsets in one address range); the
NVMe backend reuses it for extents in its swap file.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from ..aligned import ALIGN, align_up


class FreeList:
    """First-fit allocator over ``[0, capacity)`` in ``ALIGN`` units, coalescing on free.

    Args:
        capacity: bytes managed (a multiple of ``ALIGN``).
    """

    def __init__(self, capacity: int):
        if capacity < 0 or capacity % ALIGN:
            raise ValueError(f"capacity={capacity} must be a non-negative multiple of {ALIGN}")
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []  # sorted free-range starts
        self._sizes: dict[int, int] = {0: capacity} if capacity else {}

    def alloc(self, nbytes: int, high: bool = False) -> int | None:
        """The offset of a free range of ``align_up(nbytes)`` bytes, or None if none is big enough.

        Args:
            nbytes: bytes wanted.
            high: take the end of the highest free range that fits (top-down first fit)
                instead of the start of the lowest one.
        """
        size = align_up(max(nbytes, 1))
        order = range(len(self._starts) - 1, -1, -1) if high else range(len(self._starts))
        for i in order:
            start = self._starts[i]
            free = self._sizes[start]
            if free < size:
                continue
            if high:  # carve from the top: the range keeps its start, shrinks or goes
                if free == size:
                    del self._starts[i], self._sizes[start]
                else:
                    self._sizes[start] = free - size
                return start + free - size
            del self._starts[i], self._sizes[start]
            if free > size:
                self._starts.insert(i, start + size)
                self._sizes[start + size] = free - size
            return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return ``[offset, offset + align_up(nbytes))`` to the free list."""
        size = align_up(max(nbytes, 1))
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + size:
            raise ValueError(f"double free of [{offset}, {offset + size})")
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] > offset:
            raise ValueError(f"double free of [{offset}, {offset + size})")
        if i < len(self._starts) and self._starts[i] == offset + size:  # merge with the next range
            size += self._sizes.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:  # and the previous
            self._sizes[self._starts[i - 1]] += size
        else:
            self._starts.insert(i, offset)
            self._sizes[offset] = size

    def take(self, offset: int, nbytes: int) -> None:
        """Mark ``[offset, offset + align_up(nbytes))`` as allocated (it must be free)."""
        size = align_up(max(nbytes, 1))
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or self._starts[i] + self._sizes[self._starts[i]] < offset + size:
            raise ValueError(f"range [{offset}, {offset + size}) is not free")
        start = self._starts[i]
        free = self._sizes.pop(start)
        del self._starts[i]
        if offset > start:
            self._starts.insert(i, start)
            self._sizes[start] = offset - start
            i += 1
        if start + free > offset + size:
            self._starts.insert(i, offset + size)
            self._sizes[offset + size] = start + free - offset - size

    def grow(self, new_capacity: int) -> None:
        """Extend the managed range to ``new_capacity`` (a multiple of ``ALIGN``)."""
        if new_capacity % ALIGN or new_capacity < self.capacity:
            raise ValueError(f"cannot grow from {self.capacity} to {new_capacity}")
        old, self.capacity = self.capacity, new_capacity
        if new_capacity > old:
            self.free(old, new_capacity - old)

    def shrink(self, new_capacity: int) -> None:
        """Cut the managed range to ``new_capacity`` (a multiple of ``ALIGN``); what is cut must be free."""
        if new_capacity % ALIGN or new_capacity > self.capacity:
            raise ValueError(f"cannot shrink from {self.capacity} to {new_capacity}")
        end = self.end_of_allocations
        if new_capacity < end:
            raise ValueError(f"cannot shrink from {self.capacity} to {new_capacity}: "
                             f"[{new_capacity}, {end}) is not free")
        if new_capacity == self.capacity:
            return
        del self._sizes[self._starts.pop()]  # the free tail [end, capacity)
        if new_capacity > end:
            self._starts.append(end)
            self._sizes[end] = new_capacity - end
        self.capacity = new_capacity

    @property
    def end_of_allocations(self) -> int:
        """The end of the highest allocated range (0 when nothing is allocated)."""
        last = self._starts[-1] if self._starts else None
        return last if last is not None and last + self._sizes[last] == self.capacity else self.capacity

    @property
    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes.values())

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as (offset, bytes), lowest first."""
        return [(start, self._sizes[start]) for start in self._starts]


@dataclass(eq=False)
class Block:
    """A range of one slab of an arena."""

    slab: int  # index of the slab
    offset: int  # byte offset in the slab (a multiple of ALIGN)
    nbytes: int  # bytes reserved (a multiple of ALIGN)


class Arena:
    """A tier's memory: slabs totalling ``budget`` bytes, created on first need.

    Args:
        budget: total bytes (rounded down to ``ALIGN``); the arena never holds more.
        alloc_slab: makes one uint8 slab ``[n]`` (``Device.alloc_device_slab`` or
            ``alloc_host_slab``).
        slab_bytes: size of each slab (default: one slab of the whole budget);
            no block can be larger than a slab.
        large_fraction: blocks of at least this share of a slab are *large* and are
            allocated top-down (see the module docstring).
    """

    def __init__(self, budget: int, alloc_slab: Callable[[int], torch.Tensor],
                 slab_bytes: int | None = None, large_fraction: float = 0.125):
        if budget < 0:
            raise ValueError(f"budget={budget} must be >= 0")
        if not 0.0 <= large_fraction <= 1.0:
            raise ValueError(f"large_fraction={large_fraction} must be in [0, 1]")
        self.budget = budget // ALIGN * ALIGN
        per = align_up(slab_bytes) if slab_bytes else self.budget
        per = min(per, self.budget) if self.budget else 0
        sizes = []
        left = self.budget
        while left > 0:
            sizes.append(min(per, left))
            left -= sizes[-1]
        self.slab_sizes = sizes
        self._alloc_slab = alloc_slab
        self._slabs: list[torch.Tensor | None] = [None] * len(sizes)
        self._free = [FreeList(n) for n in sizes]
        self.held = 0  # bytes in allocated blocks
        self.large_bytes = int(self.slab_bytes * large_fraction)  # allocated top-down from here

    @property
    def slab_bytes(self) -> int:
        """The largest block this arena can ever hold."""
        return max(self.slab_sizes, default=0)

    @property
    def largest_free(self) -> int:
        return max((f.largest_free for f in self._free), default=0)

    def alloc(self, nbytes: int) -> Block | None:
        """A block of ``align_up(nbytes)`` bytes, or None when no slab has room."""
        high = nbytes >= self.large_bytes
        for i, fl in enumerate(self._free):
            off = fl.alloc(nbytes, high=high)
            if off is not None:
                if self._slabs[i] is None:
                    self._slabs[i] = self._alloc_slab(self.slab_sizes[i])[: self.slab_sizes[i]]
                blk = Block(i, off, align_up(max(nbytes, 1)))
                self.held += blk.nbytes
                return blk
        return None

    def free(self, block: Block) -> None:
        """Return a block to its slab."""
        self._free[block.slab].free(block.offset, block.nbytes)
        self.held -= block.nbytes

    def bytes_of(self, block: Block) -> torch.Tensor:
        """The whole block as a uint8 tensor ``[block.nbytes]`` (padding included)."""
        return self._slabs[block.slab][block.offset: block.offset + block.nbytes]

    def view(self, block: Block, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The block's first bytes as a tensor of ``shape`` / ``dtype`` (no copy)."""
        n = 1
        for d in shape:
            n *= d
        raw = self.bytes_of(block)[: n * dtype.itemsize]
        return raw.view(dtype).view(shape)

    def discard_free(self) -> int:
        """Return the free ranges' pages to the OS (RAM slabs only: never pinned or device
        memory); a block later allocated there is backed again on first touch, zero-filled.

        Returns:
            Bytes discarded.
        """
        from .directio import discard_pages

        done = 0
        for slab, free in zip(self._slabs, self._free, strict=True):
            if slab is not None:
                done += sum(discard_pages(slab[off:off + n]) for off, n in free.free_ranges())
        return done

    def release_slabs(self) -> None:
        """Drop the slabs (all blocks must have been freed)."""
        self._slabs = [None] * len(self.slab_sizes)
