"""Direct file I/O: ``O_DIRECT`` files, a bounded I/O thread pool.

The lowest layer of the NVMe tier (docs/architecture.md §3). Everything above it
(extents, checksums, the swap directory) lives in ``nvme.py`` / ``swapdir.py``.

- Its buffers are ``outcore.offload.device.aligned_empty``'s: page (4 KiB) aligned,
  as ``O_DIRECT`` requires of the user buffer.
- ``open_direct(path)`` opens with ``O_DIRECT`` and falls back to buffered I/O
  on file systems that refuse it (tmpfs, some overlay/FUSE mounts); the caller
  learns which one it got and reports it.
- ``IOPool`` splits a request into chunks and runs ``os.preadv`` / ``os.pwritev``
  on a small thread pool. CPython releases the GIL during those syscalls, so the
  pool keeps ``queue_depth`` requests at the disk while Python computes.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from ..aligned import ALIGN, align_up, aligned_empty

DEFAULT_CHUNK_BYTES = 8 << 20  # one syscall moves at most this much (8 MiB x 8 in flight measured best here)
DEFAULT_QUEUE_DEPTH = 8  # syscalls in flight at once (= I/O threads)


def discard_pages(buf: torch.Tensor) -> int:
    """Give the whole pages inside ``buf`` back to the OS (``madvise(MADV_DONTNEED)``).

    For private anonymous memory (:func:`aligned_empty`, never pinned or device memory):
    the pages leave the process's RSS now and come back zero-filled on the next touch.

    Returns:
        Bytes discarded.
    """
    start = align_up(buf.data_ptr())
    end = (buf.data_ptr() + buf.numel() * buf.element_size()) // ALIGN * ALIGN
    if end <= start:
        return 0
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {end - start} bytes failed")
    return end - start


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_DONTNEED = 4  # Linux


def is_aligned(buf: torch.Tensor, offset: int = 0) -> bool:
    """True when the buffer address, its byte length and the file offset all suit ``O_DIRECT``."""
    n = buf.numel() * buf.element_size()
    return buf.data_ptr() % ALIGN == 0 and n % ALIGN == 0 and offset % ALIGN == 0


def open_direct(path: str | Path, flags: int = os.O_RDWR | os.O_CREAT, mode: int = 0o600,
                direct: bool = True) -> tuple[int, bool]:
    """Open ``path`` for direct I/O when the file system allows it.

    Args:
        path: the file.
        flags: ``os.open`` flags (``O_DIRECT`` is added here).
        mode: permission bits of a created file.
        direct: ask for ``O_DIRECT`` at all.

    Returns:
        ``(fd, is_direct)``; ``is_direct`` is False when the file system refused
        ``O_DIRECT`` (EINVAL, e.g. tmpfs) and the file is open for buffered I/O.

    Raises:
        OSError: the file cannot be opened at all (missing dir, permissions).
    """
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        try:
            return os.open(path, flags | o_direct, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def supports_o_direct(directory: str | Path) -> bool:
    """Whether files in ``directory`` accept an aligned ``O_DIRECT`` write and read.

    Some file systems accept the ``O_DIRECT`` flag at open and fail the first
    I/O instead, so this does one 4 KiB round trip in a temporary file.
    """
    path = Path(directory) / f".outcore-odirect-probe-{os.getpid()}-{threading.get_ident()}"
    fd = -1
    try:
        fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        if not direct:
            return False
        buf = aligned_empty(ALIGN)
        mv = memoryview(buf.numpy())
        return os.pwritev(fd, [mv], 0) == ALIGN and os.preadv(fd, [mv], 0) == ALIGN
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            path.unlink()
        except OSError:
            pass


def _byte_view(buf: torch.Tensor | memoryview) -> memoryview:
    """A writable flat byte memoryview of a contiguous CPU tensor or buffer."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("direct I/O needs a contiguous CPU buffer")
        return memoryview(buf.reshape(-1).view(torch.uint8).numpy())
    return buf.cast("B") if buf.format != "B" else buf


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    """``pwritev`` until every byte of ``mv`` is at ``offset`` (short writes are retried).

    Raises:
        OSError: from the syscall (ENOSPC, EIO, ...).
    """
    done, n = 0, mv.nbytes
    while done < n:
        k = os.pwritev(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {k} bytes at offset {offset + done}")
        done += k


def pread_all(fd: int, mv: memoryview, offset: int) -> int:
    """``preadv`` into ``mv`` from ``offset`` until full or end of file.

    Returns:
        The number of bytes read (less than ``mv.nbytes`` only at end of file).
    """
    done, n = 0, mv.nbytes
    while done < n:
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k == 0:
            break
        done += k
    return done


class _Gather:
    """Completes one outer Future when all of its chunk tasks are done."""

    def __init__(self, outer: Future, parts: int, on_done: Callable[[list], object] | None):
        self.outer, self.left, self.on_done = outer, parts, on_done
        self.lock, self.error = threading.Lock(), None
        self.values: list = [None] * parts  # per-chunk results, in chunk order

    def part_done(self, index: int, fut: Future) -> None:
        exc = fut.exception()
        with self.lock:
            if exc is not None and self.error is None:
                self.error = exc
            if exc is None:
                self.values[index] = fut.result()
            self.left -= 1
            last = self.left == 0
        if not last:
            return
        # The last chunk's thread finishes the request (journal, accounting) so
        # the submitting thread never blocks on I/O.
        if self.error is not None:
            self.outer.set_exception(self.error)
            return
        try:
            result = self.on_done(self.values) if self.on_done is not None else sum(v[0] for v in self.values)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self.outer.set_exception(e)
        else:
            self.outer.set_result(result)


ChunkHook = Callable[[memoryview], object]


class IOPool:
    """A small pool of I/O threads with a bounded number of syscalls in flight.

    A request is split into chunks of ``chunk_bytes`` that run in parallel. An
    optional ``chunk_hook`` runs on the worker right after each chunk's syscall
    (the NVMe tier hashes there, so checksums are computed in parallel and
    overlap other chunks' I/O); ``on_done`` receives the list of
    ``(nbytes, hook_value)`` per chunk, in order, on the thread that finished last.

    Args:
        queue_depth: I/O threads = syscalls in flight (the disk's queue depth).
        chunk_bytes: largest single syscall.
    """

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if queue_depth < 1:
            raise ValueError(f"queue_depth={queue_depth} must be >= 1")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {ALIGN}")
        self.queue_depth, self.chunk_bytes = queue_depth, chunk_bytes
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="outcore-io")

    def _submit(self, fn, fd: int, buf, offset: int, on_done, hook: ChunkHook | None) -> Future:
        mv = _byte_view(buf)
        outer: Future = Future()
        outer.set_running_or_notify_cancel()
        starts = range(0, max(mv.nbytes, 1), self.chunk_bytes)
        gather = _Gather(outer, len(starts), on_done)

        def task(part: memoryview, off: int):
            n = fn(fd, part, off)
            return n, (hook(part) if hook is not None else None)
        for i, s in enumerate(starts):
            f = self._pool.submit(task, mv[s:s + self.chunk_bytes], offset + s)
            f.add_done_callback(functools.partial(gather.part_done, i))
        return outer

    def write(self, fd: int, buf: torch.Tensor | memoryview, offset: int,
              on_done: Callable[[list], object] | None = None, chunk_hook: ChunkHook | None = None) -> Future:
        """Write all of ``buf`` at ``offset``; the Future's result is ``on_done(values)`` (or bytes written).

        ``chunk_hook`` sees each chunk's bytes after they were written.
        """
        def _w(fd, mv, off):
            pwrite_all(fd, mv, off)
            return mv.nbytes
        return self._submit(_w, fd, buf, offset, on_done, chunk_hook)

    def read(self, fd: int, buf: torch.Tensor | memoryview, offset: int,
             on_done: Callable[[list], object] | None = None, chunk_hook: ChunkHook | None = None) -> Future:
        """Fill ``buf`` from ``offset``; a short read (truncated file) fails the Future with EIO.

        ``chunk_hook`` sees each chunk's bytes after they were read.
        """
        def _r(fd, mv, off):
            k = pread_all(fd, mv, off)
            if k != mv.nbytes:
                raise OSError(errno.EIO, f"short read: {k} of {mv.nbytes} bytes at offset {off} "
                                         "(file truncated)")
            return k
        return self._submit(_r, fd, buf, offset, on_done, chunk_hook)

    def run(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on an I/O thread (e.g. an ``fsync``)."""
        return self._pool.submit(fn)

    def close(self) -> None:
        """Wait for queued I/O and stop the threads."""
        self._pool.shutdown(wait=True)
