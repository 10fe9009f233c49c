"""The NVMe tier: checksummed extents in one preallocated swap file (docs/architecture.md §3).

Layout of a swap directory::

    extents.bin   4 KiB-aligned extents, O_DIRECT (buffered where the FS refuses it)
    extents.idx   append-only journal: one line per completed write
                  "key offset length checksum\\t<xxh32 of the line>"; rewritten
                  (atomically: a new file renamed over it) with one line per live
                  extent when it grows JOURNAL_COMPACT_RATIO times that, so it stays
                  bounded however long the run

A write is reported complete only after its data is written *and* its journal
line is appended; with ``durable=True`` both files are ``fdatasync``-ed first.
Reading verifies the xxh3-64 of the whole extent (padding included), so a
flipped byte, a truncated file or an extent torn by a crash mid-write raises
:class:`IntegrityError` naming the file and the extent — it is never returned
as data. :meth:`NvmeBackend.recover` rebuilds the extent table from the
journal (a torn last journal line fails its own checksum and is ignored).
"""
from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xxhash

from ...errors import IntegrityError, SwapDirError
from .arena import FreeList
from ..aligned import ALIGN, align_up
from .directio import IOPool, is_aligned, open_direct
from .swapdir import SwapDir
from ._futures import chain as _chain

DATA_FILE, INDEX_FILE = "extents.bin", "extents.idx"


#: the journal is rewritten with one line per live extent once it holds this many times as
#: many lines (and at least JOURNAL_COMPACT_MIN): a long run's journal stays bounded
JOURNAL_COMPACT_RATIO, JOURNAL_COMPACT_MIN = 4, 1024


def reserve_margin(nbytes: int) -> int:
    """Room an unbounded swap file grows by beyond a request past its end: 1/16 of the new
    size, at least 16 MiB (so a run whose need grows a little, e.g. with offloaded activations,
    does not preallocate at every extent, nor hold gigabytes a small model never uses)."""
    return max(16 << 20, align_up(nbytes // 16))


@dataclass(eq=False)
class Extent:
    """Where one tensor lives in the swap file."""

    key: str
    offset: int  # byte offset in extents.bin (a multiple of ALIGN)
    length: int  # bytes reserved and transferred (a multiple of ALIGN)
    checksum: int | None = None  # xxh3-64 of the last completed write; None = never written


CHECKSUM_BLOCK = 1 << 20  # an extent's checksum is the xxh3-64 of the xxh3-64s of its 1 MiB blocks


def _block_digests(mv: memoryview) -> bytes:
    """Concatenated 8-byte xxh3-64 digests of each ``CHECKSUM_BLOCK`` of ``mv`` (runs on an I/O thread)."""
    return b"".join(xxhash.xxh3_64_digest(mv[i:i + CHECKSUM_BLOCK]) for i in range(0, len(mv), CHECKSUM_BLOCK))


def _combine(values: list) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(v[1] for v in values))


def checksum(buf: torch.Tensor) -> int:
    """The extent checksum of a contiguous CPU uint8 tensor (what a write of it records).

    Two-level so that each I/O chunk hashes its own blocks in parallel: the
    xxh3-64 over the xxh3-64 digests of consecutive 1 MiB blocks.
    """
    return xxhash.xxh3_64_intdigest(_block_digests(memoryview(buf.numpy())))


class NvmeBackend:
    """Extents in one swap file, read and written through an :class:`IOPool`.

    Args:
        swap: the (locked) swap directory.
        capacity: bytes to preallocate now (``posix_fallocate``): the NVMe tier's
            budget. ``None`` = unbounded: :meth:`reserve` what the run needs up front;
            beyond it the file grows by each request plus :func:`reserve_margin`.
        pool: the I/O pool (default: a fresh ``IOPool()``; closed with the backend).
        direct: use ``O_DIRECT`` when the file system allows it.

    Raises:
        DiskFullError: the swap dir has not enough free space for ``capacity``.
    """

    def __init__(self, swap: SwapDir, capacity: int | None = None, pool: IOPool | None = None,
                 direct: bool = True, _recover: bool = False):
        self.swap = swap
        self.path = swap.file(DATA_FILE)
        self.index_path = swap.file(INDEX_FILE)
        self._own_pool = pool is None
        self.pool = pool or IOPool()
        if self.pool.chunk_bytes % CHECKSUM_BLOCK:
            raise ValueError(f"IOPool chunk_bytes={self.pool.chunk_bytes} must be a multiple of "
                             f"{CHECKSUM_BLOCK} (the checksum block)")
        flags = os.O_RDWR | os.O_CREAT | (0 if _recover else os.O_TRUNC)
        self.fd, self.direct = open_direct(self.path, flags, direct=direct)
        self._ifd = os.open(self.index_path, os.O_RDWR | os.O_CREAT | os.O_APPEND
                            | (0 if _recover else os.O_TRUNC), 0o600)
        self.budget = align_up(capacity) if capacity is not None else None
        self._lock = threading.Lock()
        # the journal's live lines (key -> its newest line: what a compacted journal holds)
        # and how many lines the file has; guarded by _journal_lock, taken on I/O threads
        self._journal_lock = threading.Lock()
        self._journal_lines: dict[str, bytes] = {}
        self._journal_count = 0
        self.read_bytes = self.written_bytes = 0
        size = os.fstat(self.fd).st_size // ALIGN * ALIGN if _recover else 0
        self._free = FreeList(0)
        try:
            self._grow_to(self.budget if self.budget is not None else size)
        except BaseException:
            self.close()
            raise

    # -- space -----------------------------------------------------------------
    def _grow_to(self, capacity: int) -> None:
        capacity = align_up(capacity)
        if capacity > self._free.capacity:
            self.swap.reserve(self.fd, capacity, name=f"the NVMe tier ({self.path.name})")
            self._free.grow(capacity)

    def reserve(self, nbytes: int) -> None:
        """Preallocate room for ``nbytes`` of extents now: what the plan says the tier will
        hold, so a disk too small fails before training. No margin: the plan's figure already
        bounds the padding from above, and :meth:`trim` gives back what the extents do not
        use; a need beyond it grows the file by :func:`reserve_margin` steps.

        Raises:
            DiskFullError: the swap dir's disk has not the room (free and needed bytes named).
        """
        if self.budget is None and nbytes > 0:
            with self._lock:
                self._grow_to(nbytes)

    def trim(self, keep: int = 0) -> None:
        """Give back the reserved room past the last extent beyond ``keep`` bytes (an unbounded
        tier only): once a run's lasting extents are placed, the file holds what they take plus
        what comes and goes during the steps (spilled gradients, offloaded activations), not
        the plan's padding bound. A later need grows the file again."""
        if self.budget is not None:
            return
        with self._lock:
            target = align_up(self._free.end_of_allocations + max(keep, 0))
            if target < self._free.capacity:
                os.ftruncate(self.fd, target)  # the blocks past it go back to the file system
                self._free.shrink(target)

    @property
    def held(self) -> int:
        """Bytes in allocated extents."""
        return self._free.capacity - self._free.free_bytes

    @property
    def capacity(self) -> int:
        """Bytes reserved on disk now."""
        return self._free.capacity

    def alloc(self, key: str, nbytes: int) -> Extent | None:
        """Reserve an extent for ``nbytes``; None when a bounded tier has no room."""
        with self._lock:
            off = self._free.alloc(nbytes)
            if off is None and self.budget is None:
                grown = self._free.capacity + align_up(max(nbytes, 1))  # room at the end, whatever the holes
                self._grow_to(grown + reserve_margin(grown))
                off = self._free.alloc(nbytes)
        return None if off is None else Extent(key, off, align_up(max(nbytes, 1)))

    def free(self, ext: Extent) -> None:
        """Return an extent's space (its bytes stay on disk until overwritten)."""
        with self._lock:
            self._free.free(ext.offset, ext.length)
        with self._journal_lock:
            self._journal_lines.pop(ext.key, None)  # a compacted journal forgets it

    # -- I/O -------------------------------------------------------------------
    def _io_error(self, ext: Extent, op: str):
        def convert(exc: BaseException) -> BaseException:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                return SwapDirError(f"swap dir {self.swap.path} is full writing extent {ext.key!r} "
                                    f"({ext.length} bytes at offset {ext.offset}); free space or "
                                    "reserve the NVMe budget up front")
            if isinstance(exc, OSError) and "short read" in str(exc):
                return IntegrityError(f"swap file {self.path} is truncated: extent {ext.key!r} "
                                      f"(offset {ext.offset}, {ext.length} bytes) is past its end")
            if isinstance(exc, OSError):
                return SwapDirError(f"{op} of extent {ext.key!r} in {self.path} failed: {exc}")
            return exc
        return convert

    def write(self, ext: Extent, src: torch.Tensor, durable: bool = False) -> Future:
        """Write ``src`` (uint8 ``[ext.length]``, 4 KiB-aligned CPU memory) to the extent.

        The caller must not change ``src`` until the Future completes.

        Args:
            ext: the extent.
            src: the bytes, padding included.
            durable: ``fdatasync`` data and journal before completing (checkpoints).

        Returns:
            A Future (result: the checksum) that fails with ``SwapDirError`` (full disk, I/O error).
        """
        self._check_buf(ext, src)

        def finish(values: list) -> int:
            h = _combine(values)  # of what was written (src is unchanged while in flight)
            if durable:
                os.fdatasync(self.fd)  # the data is on the disk before the journal says so
            self._journal(ext, h, durable)
            with self._lock:
                ext.checksum = h
                self.written_bytes += ext.length
            return h
        f = self.pool.write(self.fd, src, ext.offset, on_done=finish, chunk_hook=_block_digests)
        return _chain(f, self._io_error(ext, "write"))

    def _journal(self, ext: Extent, h: int, durable: bool) -> None:
        """Append ``ext``'s completed write to the journal (compacting it when it has grown)."""
        line = f"{ext.key}\t{ext.offset}\t{ext.length}\t{h}"
        entry = f"{line}\t{xxhash.xxh32_intdigest(line.encode())}\n".encode()
        with self._journal_lock:
            os.write(self._ifd, entry)
            self._journal_lines[ext.key] = entry
            self._journal_count += 1
            if self._journal_count > max(JOURNAL_COMPACT_MIN, JOURNAL_COMPACT_RATIO * len(self._journal_lines)):
                self._compact_journal()
            if durable:
                os.fdatasync(self._ifd)

    def _compact_journal(self) -> None:
        """Rewrite the journal as one line per live extent: written beside it, synced, then
        renamed over it, so a crash leaves the old journal or the new one, never half of one."""
        tmp = self.index_path.with_name(INDEX_FILE + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            data = memoryview(b"".join(self._journal_lines.values()))
            while data:
                data = data[os.write(fd, data):]
            os.fdatasync(fd)
            os.replace(tmp, self.index_path)
        except BaseException:
            os.close(fd)
            raise
        os.close(self._ifd)
        self._ifd, self._journal_count = fd, len(self._journal_lines)

    def read(self, ext: Extent, dst: torch.Tensor) -> Future:
        """Read the extent into ``dst`` (uint8 ``[ext.length]``, aligned) and verify its checksum.

        Returns:
            A Future that fails with ``IntegrityError`` (checksum mismatch, truncated file).
        """
        self._check_buf(ext, dst)
        if ext.checksum is None:
            raise IntegrityError(f"extent {ext.key!r} of {self.path} was never written; write it before reading")

        def verify(values: list) -> torch.Tensor:
            got = _combine(values)
            if got != ext.checksum:
                raise IntegrityError(f"checksum mismatch in swap file {self.path}, extent {ext.key!r} "
                                     f"(offset {ext.offset}, {ext.length} bytes): the file is corrupt")
            with self._lock:
                self.read_bytes += ext.length
            return dst
        f = self.pool.read(self.fd, dst, ext.offset, on_done=verify, chunk_hook=_block_digests)
        return _chain(f, self._io_error(ext, "read"))

    def _check_buf(self, ext: Extent, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.numel() != ext.length or buf.device.type != "cpu":
            raise ValueError(f"extent {ext.key!r} needs a CPU uint8 buffer of {ext.length} bytes, "
                             f"got {buf.dtype} [{buf.numel()}] on {buf.device}")
        if self.direct and not is_aligned(buf, ext.offset):
            raise ValueError(f"O_DIRECT needs a {ALIGN}-byte aligned buffer for extent {ext.key!r}")

    def sync(self) -> None:
        """``fdatasync`` the swap file and the journal."""
        os.fdatasync(self.fd)
        os.fdatasync(self._ifd)

    # -- recovery --------------------------------------------------------------
    @classmethod
    def recover(cls, swap: SwapDir, pool: IOPool | None = None) -> tuple["NvmeBackend", dict[str, Extent]]:
        """Reopen a swap dir left by another process and rebuild its extents from the journal.

        The last complete journal line per key wins; a torn line is ignored, and
        an extent whose data was torn fails its checksum on read.

        Returns:
            ``(backend, {key: Extent})``.
        """
        backend = cls(swap, None, pool, _recover=True)
        table: dict[str, Extent] = {}
        with open(backend.index_path, "rb") as f:
            for raw in f:
                parts = raw.decode(errors="replace").rstrip("\n").split("\t")
                if len(parts) != 5:
                    continue
                line = "\t".join(parts[:4])
                if str(xxhash.xxh32_intdigest(line.encode())) != parts[4]:
                    continue  # torn or corrupt journal line
                key, off, length, h = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
                table[key] = Extent(key, off, length, h)
                backend._journal_lines[key] = raw if raw.endswith(b"\n") else raw + b"\n"
                backend._journal_count += 1
        backend._grow_to(max((e.offset + e.length for e in table.values()), default=0))
        for e in table.values():
            backend._free.take(e.offset, e.length)
        return backend, table

    def close(self) -> None:
        """Close the files (the swap dir removes them) and the pool if it is ours."""
        if self._own_pool:
            self.pool.close()
        if self.fd >= 0:
            os.close(self.fd)
            os.close(self._ifd)
            self.fd = -1
