"""Where the ZO schedule gets each block's clean weights: RAM or the disk.

A block source hands the schedule (:mod:`outcore.optim.zo_stream`) the
authoritative ("clean") fp32 tensors of one block at a time:

* :class:`HostBlockSource` — the model's own parameters in RAM (in-memory ZO);
* :class:`FileBlockSource` — one file per block in a swap directory, read with
  ``O_DIRECT`` by an I/O thread pool into a few page-aligned buffers, prefetched
  ``prefetch`` blocks ahead, and written back in place after the block's update.
  The process holds only those buffers, so a model larger than RAM trains.

Parameters used by more than one block (a tied embedding / LM head) stay
resident in RAM in both sources: they are needed at both ends of the step.

Protocol (what the schedule calls)::

    tensors = source.acquire(b)      # clean tensors of block b, in block.params order
    source.prefetch(b2)              # hint: block b2 is needed soon
    source.release(b, dirty)         # done with b; write it back if dirty
    source.close()
"""
from __future__ import annotations

import os
import queue
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..errors import SwapDirError
from .zo_blocks import ZOBlock

_ALIGN = 4096


class BlockSource(Protocol):
    def acquire(self, b: int) -> list[torch.Tensor]: ...

    def prefetch(self, b: int) -> None: ...

    def release(self, b: int, dirty: bool) -> None: ...

    def close(self) -> None: ...


def _shared_indices(blocks: list[ZOBlock]) -> set[int]:
    count: dict[int, int] = {}
    for blk in blocks:
        for j, _ in blk.params:
            count[j] = count.get(j, 0) + 1
    return {j for j, c in count.items() if c > 1}


class HostBlockSource:
    """Blocks whose clean weights are the model's parameters, in RAM (no I/O)."""

    def __init__(self, blocks: list[ZOBlock]) -> None:
        self._clean = [[p.data for _, p in blk.params] for blk in blocks]
        self.read_bytes = self.written_bytes = 0
        self.stall_s = 0.0

    def acquire(self, b: int) -> list[torch.Tensor]:
        return self._clean[b]

    def prefetch(self, b: int) -> None:
        return None

    def release(self, b: int, dirty: bool) -> None:
        return None

    def close(self) -> None:
        return None


class FileBlockSource:
    """Blocks streamed from one file each in ``swap_dir``, updated in place.

    Args:
        blocks: the schedule's blocks; their parameters' current values are written
            to disk and the parameters are emptied (``p.data`` = a 0-element tensor)
            except those shared by several blocks, which stay resident.
        swap_dir: an existing writable directory (files ``zo_block_<b>.bin``).
        prefetch: blocks read ahead of the one computing.
        direct: use ``O_DIRECT`` (falls back to buffered I/O where refused).
        materialize: called with each block just before its weights are written, so a
            model built on the ``meta`` device can be initialized one block at a time
            (it never exists whole in RAM).

    Raises:
        SwapDirError: ``swap_dir`` does not exist or is not writable.
    """

    def __init__(self, blocks: list[ZOBlock], swap_dir: str | Path, prefetch: int = 2,
                 direct: bool = True, materialize: Callable[[ZOBlock], None] | None = None) -> None:
        from ..offload.directio import IOPool, aligned_empty, open_direct

        swap = Path(swap_dir)
        if not swap.is_dir() or not os.access(swap, os.W_OK):
            raise SwapDirError(f"swap_dir {str(swap)!r} is not a writable directory; create it or pick another")
        shared = _shared_indices(blocks)
        self._resident: dict[int, torch.Tensor] = {}
        self._layout: list[list[tuple[int, int, torch.Size, torch.dtype]]] = []  # offset -1 = resident
        self._nbytes: list[int] = []
        for blk in blocks:
            lay, off = [], 0
            for j, p in blk.params:
                if j in shared:
                    self._resident.setdefault(j, p.data)
                    lay.append((j, -1, p.shape, p.dtype))
                    continue
                nb = p.numel() * p.element_size()
                lay.append((j, off, p.shape, p.dtype))
                off += (nb + 63) // 64 * 64  # 64-byte aligned views
            self._layout.append(lay)
            self._nbytes.append((off + _ALIGN - 1) // _ALIGN * _ALIGN)
        self.prefetch_depth = max(0, int(prefetch))
        self._io = IOPool(queue_depth=4)
        cap = max(self._nbytes + [_ALIGN])
        # current + prefetched + one being written back + one spare for the wrap-around to the next step
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(self.prefetch_depth + 3):
            self._free.put(aligned_empty(cap))
        self._fds, self.direct = [], True
        for b, blk in enumerate(blocks):
            fd, direct = open_direct(swap / f"zo_block_{b}.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            self._fds.append(fd)
            self.direct &= direct
            if materialize is not None:
                materialize(blk)
            buf = self._free.get()
            for (_, p), spec in zip(blk.params, self._layout[b]):
                if spec[1] >= 0:
                    self._view(buf, spec).copy_(p.data)
                    p.data = torch.empty(0, dtype=p.dtype)  # the disk holds it now
            self._io.write(fd, buf[: self._nbytes[b]], 0).result()
            self._free.put(buf)
        self._reads: dict[int, tuple[torch.Tensor, Future]] = {}
        self._writes: dict[int, tuple[torch.Tensor, Future]] = {}
        self._held: dict[int, torch.Tensor] = {}
        self.read_bytes = self.written_bytes = 0
        self.stall_s = 0.0  # compute time spent waiting on the disk

    @staticmethod
    def _view(buf: torch.Tensor, spec: tuple[int, int, torch.Size, torch.dtype]) -> torch.Tensor:
        _, off, shape, dtype = spec
        nb = shape.numel() * torch.empty(0, dtype=dtype).element_size()
        return buf[off:off + nb].view(dtype).view(shape)

    def _recycle_writes(self) -> None:
        for b in [b for b, (_, f) in self._writes.items() if f.done()]:
            buf, fut = self._writes.pop(b)
            fut.result()  # surfaces an I/O error here, not silently
            self._free.put(buf)

    def prefetch(self, b: int) -> None:
        """Start reading block ``b`` if a buffer is free (never blocks)."""
        if b in self._reads or b in self._held or not 0 <= b < len(self._fds):
            return
        self._recycle_writes()
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            return
        if b in self._writes:  # read-after-write: the block's last update must be on disk first
            self._writes[b][1].result()
        self._reads[b] = (buf, self._io.read(self._fds[b], buf[: self._nbytes[b]], 0))
        self.read_bytes += self._nbytes[b]

    def acquire(self, b: int) -> list[torch.Tensor]:
        """Clean tensors of block ``b`` (waits for its read: a stall if not prefetched)."""
        if b not in self._reads:
            t0 = time.perf_counter()
            while b not in self._reads:  # every buffer busy: wait for a write-back to finish
                self._recycle_writes()
                self.prefetch(b)
                if b not in self._reads:
                    time.sleep(0.0005)
            self.stall_s += time.perf_counter() - t0
        buf, fut = self._reads.pop(b)
        t0 = time.perf_counter()
        fut.result()  # sync point: the compute needs these bytes now
        self.stall_s += time.perf_counter() - t0
        self._held[b] = buf
        return [self._resident[spec[0]] if spec[1] < 0 else self._view(buf, spec) for spec in self._layout[b]]

    def release(self, b: int, dirty: bool) -> None:
        """Done with block ``b``: write it back in place if it changed, else free its buffer."""
        buf = self._held.pop(b)
        if dirty:
            self._writes[b] = (buf, self._io.write(self._fds[b], buf[: self._nbytes[b]], 0))
            self.written_bytes += self._nbytes[b]
        else:
            self._free.put(buf)

    def close(self) -> None:
        """Finish pending writes and close the files (they stay on disk; the caller owns swap_dir)."""
        for _, fut in list(self._writes.values()) + list(self._reads.values()):
            fut.result()
        self._io.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class StoreBlockSource:
    """Blocks streamed from NVMe through :class:`outcore.offload.TieredStore` (the default).

    One handle per block (the block's non-shared parameters packed into one flat
    byte tensor, home NVME, checksummed extents, ``O_DIRECT``); a cyclic
    :class:`outcore.offload.PrefetchQueue` over the blocks in visit order fetches
    ``prefetch`` blocks ahead into the HOST tier (the compute tier on a CPU run)
    and writes updated blocks back asynchronously. The HOST budget is
    ``prefetch + 2`` blocks, so the store — not a convention — bounds RSS.

    Args:
        blocks: the schedule's blocks (parameters emptied as in FileBlockSource).
        swap_dir: the run's swap directory (created 0700 and locked by the store;
            removed on :meth:`close`).
        prefetch: blocks fetched ahead.
        materialize: as for FileBlockSource.
    """

    def __init__(self, blocks: list[ZOBlock], swap_dir: str | Path, prefetch: int = 2,
                 materialize: Callable[[ZOBlock], None] | None = None) -> None:
        from ..offload import PrefetchQueue, Tier, TieredStore

        shared = _shared_indices(blocks)
        self._resident: dict[int, torch.Tensor] = {}
        self._layout: list[list[tuple[int, int, torch.Size, torch.dtype]]] = []
        nbytes = []
        for blk in blocks:
            lay, off = [], 0
            for j, p in blk.params:
                if j in shared:
                    lay.append((j, -1, p.shape, p.dtype))
                    continue
                lay.append((j, off, p.shape, p.dtype))
                off += (p.numel() * p.element_size() + 63) // 64 * 64
            self._layout.append(lay)
            nbytes.append(max(off, 64))
        depth = max(0, int(prefetch))
        total = sum(nbytes)
        self.store = TieredStore(device_bytes=0, host_bytes=(depth + 2) * max(nbytes) + _ALIGN * (depth + 2),
                                 nvme_bytes=None, swap_dir=swap_dir)
        self._handles = []
        try:
            for b, blk in enumerate(blocks):
                if materialize is not None:
                    materialize(blk)
                flat = torch.empty(nbytes[b], dtype=torch.uint8)  # transient: one block
                for (_, p), spec in zip(blk.params, self._layout[b]):
                    if spec[1] < 0:
                        self._resident.setdefault(spec[0], p.data)
                    else:
                        FileBlockSource._view(flat, spec).copy_(p.data)
                        p.data = torch.empty(0, dtype=p.dtype)  # the store holds it now
                self._handles.append(self.store.register(f"zo_block{b}", data=flat, home=Tier.NVME))
                del flat
            self.pq = PrefetchQueue(self.store, self._handles, Tier.HOST, depth=depth, cyclic=True)
        except BaseException:
            self.store.close()
            raise
        self.nvme_bytes = total
        self.direct = True

    @property
    def stall_s(self) -> float:
        return self.pq.stall_s

    @property
    def read_bytes(self) -> int:
        return self.store.tier_stats()["NVME"].read_bytes

    @property
    def written_bytes(self) -> int:
        return self.store.tier_stats()["NVME"].written_bytes

    def acquire(self, b: int) -> list[torch.Tensor]:
        flat = self.pq.get(self._handles[b])  # waits only if the prefetch is late (a stall)
        return [self._resident[spec[0]] if spec[1] < 0 else FileBlockSource._view(flat, spec)
                for spec in self._layout[b]]

    def prefetch(self, b: int) -> None:
        return None  # the PrefetchQueue follows the cyclic order by itself

    def release(self, b: int, dirty: bool) -> None:
        self.pq.done(self._handles[b], dirty=dirty)  # async write-back to NVMe when dirty

    def close(self) -> None:
        self.pq.close()
        self.store.close()
