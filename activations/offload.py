"""Saved-activation offload through the tiered store, one transfer per block, prefetched for backward.

Inside an offloaded block's forward, a ``saved_tensors_hooks`` pack hook sees
every tensor autograd saves. Parameters (and views of them), tensors smaller
than ``min_bytes`` (RoPE tables shared by every block, norms' ``rsqrt``) and
sparse or strided-out tensors go to the *outer* hooks unchanged, so this
composes with the out-of-core engine's own pack hook for weights. The rest go
into the block's :class:`~.pack.BlockPack` (deduplicated by storage).

When the block's forward returns, the pack is sealed and handed to the copy
thread, which copies it into one buffer and stores it with one call:

- ``OFFLOAD_NVME``: a pooled page-aligned HOST buffer (pinned on CUDA), then one
  checksummed ``O_DIRECT`` write into an anonymous extent of the store's NVMe tier
  (``store.alloc_extent`` / ``write_extent``: its budget and traffic counters apply;
  reserved on the caller's thread, so a budget too small fails at once, in the
  forward, naming the block);
- ``OFFLOAD_HOST``: a block of the store's HOST arena (``store.register``). (``RECOMPUTE_*``: one tensor, its input.)

The forward never waits for the disk, only for backpressure: at most
``max_inflight_bytes`` of sealed blocks may wait for their write.

With ``compress`` (``int8`` / ``fp8``, :mod:`.compress`) the copy into the buffer
encodes the block's floating-point groups 8-bit, so the extent, the HOST handle
and the traffic counted are the compressed bytes; the unpack decodes them.

Backward visits blocks in reverse (the known future): when the gradient of
block ``i``'s output appears, reads of blocks ``i .. i-depth`` start on the store's
I/O threads (``store.read_extent``: no thread of ours waits for the disk), into
pooled buffers (on an accelerator then copied to the device on a side stream). An
unpack waits only for what has not arrived yet, and the restored tensors are views
of the block's buffer, which goes back to the pool when the last of them is freed:
no allocation, page fault or pinning per step.
"""
from __future__ import annotations

import functools
import itertools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import BudgetError
from ..offload.device import SideStreams, compute_event, hand_to_compute, is_accelerator
from .compress import codec_for
from .pack import BlockPack, PackedRef
from .policy import ActivationPolicy

_MIN_BYTES = 512 << 10  # smaller saved tensors stay put (RoPE cos/sin are shared by all blocks)
_GRANULE = 1 << 20  # pooled buffers are whole MiB, so blocks of nearly equal size share them


def lend(buf: torch.Tensor, nbytes: int, on_free: Callable[[], Any]) -> torch.Tensor:
    """A uint8 tensor ``[nbytes]`` over ``buf``'s first bytes; ``on_free()`` runs when its storage dies.

    The storage is a separate one over the same memory (through numpy), so its
    death (the last view of the restored activations freed) is observable.
    """
    arr = buf.numpy()[:nbytes]
    out = torch.from_numpy(arr)
    weakref.finalize(arr, on_free).atexit = False
    return out


class BufferPool:
    """Reusable page-aligned HOST buffers (pinned on CUDA): no page fault or pinning per transfer.

    Args:
        alloc: ``alloc(nbytes) -> uint8 tensor`` (the store device's ``alloc_host_slab``).
        keep: free buffers kept for reuse; more are returned to the OS.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], keep: int, can_discard: bool = False):
        self._alloc, self.keep = alloc, int(keep)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.live_bytes = 0  # bytes of buffers the pool made that still exist (free or in use)
        self._can_discard = can_discard  # plain RAM buffers (not pinned): pages may go back to the OS
        self._idle = False

    def idle(self) -> None:
        """No buffer is wanted for a while (forward over, backward not begun: the loss, the
        step's memory peak): free buffers give their pages back to the OS, and so do those
        given back until the next :meth:`take`. They stay in the pool; a later use faults
        fresh zero pages in."""
        if not self._can_discard:
            return
        from ..offload.store import discard_pages

        with self._lock:
            self._idle = True
            for b in self._free:
                discard_pages(b)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (the smallest free one that fits, or a new one)."""
        size = -(-max(nbytes, 1) // _GRANULE) * _GRANULE
        with self._lock:
            self._idle = False
            fits = [b for b in self._free if b.numel() >= size]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                return buf
            self.live_bytes += size
        return self._alloc(size)

    def give(self, buf: torch.Tensor) -> None:
        """Return ``buf`` (kept for reuse, or dropped beyond ``keep``)."""
        with self._lock:
            if len(self._free) < self.keep:
                if self._idle:
                    from ..offload.store import discard_pages

                    discard_pages(buf)
                self._free.append(buf)
            else:
                self.live_bytes -= buf.numel()

    def clear(self) -> None:
        with self._lock:
            self.live_bytes -= sum(b.numel() for b in self._free)
            self._free = []


class _Block:
    """One offloaded block of one step: its pack and its I/O futures. Owned by the autograd graph."""

    __slots__ = ("owner", "index", "tier", "pack", "landed", "read", "base", "__weakref__")

    def __init__(self, owner: "ActivationOffloader", index: int, tier):
        self.owner, self.index, self.tier = owner, index, tier
        self.pack = BlockPack(codec=owner.codec)
        self.landed: Future | None = None  # result: the NVMe extent or HOST handle holding the bytes
        self.read: Future | None = None  # result: (uint8 buffer, CUDA event | None)
        self.base: torch.Tensor | None = None  # the restored buffer, once unpacked

    def __del__(self):  # the graph let go: free the stored bytes unless a read owns them
        owner = self.owner
        if owner is not None and self.read is None and self.base is None and self.landed is not None:
            owner._discard(self.landed, self.tier)


class ActivationOffloader:
    """Moves the saved activations of chosen blocks to HOST or NVME and back, one buffer per block.

    Args:
        store: the :class:`~outcore.offload.TieredStore` whose HOST / NVME tiers hold
            the offloaded bytes (with a swap dir for NVME).
        min_bytes: saved tensors smaller than this stay where they are.
        prefetch_depth: blocks read ahead of the one whose backward starts.
        max_inflight_bytes: bytes (uncompressed) of sealed blocks waiting for their write before
            the next block's seal waits.
        pool_keep: free transfer buffers kept for reuse (default ``prefetch_depth + 1``: what
            the backward holds at once, the block in use and those read ahead; more would
            sit idle through the loss, the step's memory peak, ~18 MiB each for SmolLM2).
        compress: ``none`` (bytes as they are) | ``int8`` | ``fp8`` (floating-point saved
            tensors stored 8-bit with per-block scales).

    Raises:
        ValueError: a negative depth or threshold, or no in-flight budget.
        ConfigError: an unknown ``compress``.
    """

    def __init__(self, store: Any, *, min_bytes: int = _MIN_BYTES, prefetch_depth: int = 2,
                 max_inflight_bytes: int = 256 << 20, pool_keep: int | None = None, compress: str = "none"):
        if prefetch_depth < 0 or min_bytes < 0 or max_inflight_bytes <= 0:
            raise ValueError(f"prefetch_depth={prefetch_depth}, min_bytes={min_bytes}, "
                             f"max_inflight_bytes={max_inflight_bytes}: need >= 0, >= 0 and > 0")
        self.store = store
        self.codec = codec_for(compress)
        self.min_bytes = int(min_bytes)
        self.prefetch_depth = int(prefetch_depth)
        self.max_inflight = int(max_inflight_bytes)
        self.pool = BufferPool(store.device.alloc_host_slab,
                               prefetch_depth + 1 if pool_keep is None else pool_keep,
                               can_discard=not store.device.is_accelerator)  # pinned pages must stay
        # The copy thread: a sealed block's copy into its buffer (encoding, or a D2H copy it waits
        # for) must not hold up the forward, nor the store's I/O threads (syscalls and checksums,
        # shared with the weights' traffic). One thread keeps writes in forward order; on an
        # accelerator it also copies read blocks to the device (in the backward: no writes then).
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="outcore-act-copy")
        self._cv = threading.Condition()
        self._inflight = 0
        self._reads: set[Future] = set()  # reads in flight (guarded by _cv), awaited by close()
        self._failed: BaseException | None = None  # a write that failed, raised at the next seal
        self._keys = itertools.count()
        # This step's blocks. Weak: the autograd graph owns each _Block, so a graph
        # dropped without a backward frees its stored bytes (_Block.__del__).
        self._blocks: dict[int, weakref.ref] = {}
        self._side = SideStreams()  # CUDA copies overlap compute; streams made on first use
        # stall_s: unpacks waiting for reads; backpressure_s: seals waiting for writes;
        # offloaded_bytes: stored (compressed) bytes, raw_bytes: the same blocks uncompressed
        self.stats = {"offloaded_bytes": 0, "raw_bytes": 0, "saved_bytes": 0, "kept_bytes": 0, "stall_s": 0.0,
                      "backpressure_s": 0.0, "tensors": 0, "blocks": 0}

    # ------------------------------------------------------------------ forward
    @contextmanager
    def block(self, index: int, policy: ActivationPolicy, module: nn.Module) -> Iterator[None]:
        """Offload what ``module`` (block ``index``) saves while the context is open.

        Raises:
            BudgetError: the NVME tier cannot hold the block (raised at the block's end).
        """
        from ..offload import Tier

        self._raise_failed()
        rec = _Block(self, index, Tier.HOST if policy.to_host else Tier.NVME)
        self._blocks[index] = weakref.ref(rec)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(t: torch.Tensor) -> Any:
            nbytes = t.numel() * t.element_size()
            base = t._base if t._base is not None else t
            ref = None
            if not (nbytes < self.min_bytes or isinstance(base, nn.Parameter) or t.is_sparse
                    or t.untyped_storage().data_ptr() in params):
                ref = rec.pack.add(t)
            if ref is None:
                self.stats["kept_bytes"] += nbytes
                return (None, outer_pack(t) if outer_pack is not None else t)
            self.stats["tensors"] += 1
            return (rec, ref)

        def unpack(packed: tuple) -> torch.Tensor:
            owner, x = packed
            if owner is None:
                return outer_unpack(x) if outer_unpack is not None else x
            return self._restore(owner, x)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self._seal(rec)

    def _seal(self, rec: _Block) -> None:
        """The block's forward is done: reserve its bytes and hand it to the copy thread."""
        from ..offload import Tier

        nbytes = rec.pack.seal()
        if nbytes == 0:
            return
        key = f"act{next(self._keys)}.b{rec.index}"
        ext = None
        if rec.tier is Tier.NVME:
            try:
                ext = self.store.alloc_extent(
                    key, nbytes, what=f"the activations of block {rec.index}",
                    advice="raise the NVMe budget, give the store a swap_dir, or keep/recompute more blocks")
            except BudgetError:
                rec.pack.release_sources()
                raise
        # backpressure: bounded bytes waiting for their write, counted raw (what a waiting block
        # keeps alive is its saved tensors, not the compressed bytes it will become)
        held = rec.pack.raw_nbytes
        with self._cv:
            if self._inflight and self._inflight + held > self.max_inflight:
                t0 = time.perf_counter()
                while self._inflight and self._inflight + held > self.max_inflight:
                    self._cv.wait()
                self.stats["backpressure_s"] += time.perf_counter() - t0
            self._inflight += held
        ready = compute_event(rec.pack.device)  # the copy's side stream must see the block fully computed
        self.stats["offloaded_bytes"] += nbytes
        self.stats["raw_bytes"] += rec.pack.raw_nbytes
        self.stats["saved_bytes"] += rec.pack.saved_bytes
        self.stats["blocks"] += 1
        rec.landed = Future()
        self._copier.submit(self._write, rec.pack, rec.tier, key, ext, ready, rec.landed)

    def _write(self, pack: BlockPack, tier, key: str, ext, ready, landed: Future) -> None:
        """Copy thread: copy the block into one buffer and start its one write (never waits for it)."""
        from ..offload import Tier

        nbytes, buf = pack.nbytes, None

        def done(result=None, exc: BaseException | None = None) -> None:
            if buf is not None:
                self.pool.give(buf)
            with self._cv:
                self._inflight -= pack.raw_nbytes
                self._cv.notify_all()
            if exc is None:
                landed.set_result(result)
            else:
                if ext is not None:
                    self.store.free_extent(ext)
                self._failed = self._failed or exc
                landed.set_exception(exc)
        try:
            if tier is Tier.HOST:
                h = self.store.register(key, shape=(nbytes,), dtype=torch.uint8, home=Tier.HOST)
                try:
                    self._copy(pack, self.store.view_of(h, Tier.HOST), ready)
                except BaseException:
                    self.store.unregister(h)
                    raise
                done(h)
                return
            buf = self.pool.take(ext.length)
            self._copy(pack, buf, ready)
            # done on a store I/O thread once the bytes are on disk (and counted on the
            # dashboard's NVMe line): the buffer is free again
            self.store.write_extent(ext, buf[:ext.length]).add_done_callback(
                lambda f: done(ext) if f.exception() is None else done(exc=f.exception()))
        except BaseException as e:  # noqa: BLE001 - delivered to the unpack / next seal
            pack.release_sources()
            done(exc=e)

    def _copy(self, pack: BlockPack, buf: torch.Tensor, ready) -> None:
        if ready is None:
            pack.copy_into(buf)
            return
        # D2H into pinned memory; blocks this thread, not the compute stream, until the bytes are
        # on the host: only then may the saved tensors go back to the caching allocator
        self._side.run_after(ready, pack.device, lambda: pack.copy_into(buf, non_blocking=True))
        pack.release_sources()

    def _raise_failed(self) -> None:
        exc, self._failed = self._failed, None
        if exc is not None:
            raise exc

    # ----------------------------------------------------------------- backward
    def backward_reached(self, index: int) -> None:
        """Block ``index``'s backward begins: start reads of it and the ``prefetch_depth`` blocks below."""
        for j in range(index, index - 1 - self.prefetch_depth, -1):
            ref = self._blocks.get(j)
            rec = ref() if ref is not None else None
            if rec is not None:
                self._prefetch(rec)

    def _prefetch(self, rec: _Block) -> None:
        """Read ``rec`` back once its write has landed (usually long done); never blocks."""
        if rec.read is None and rec.base is None and rec.landed is not None:
            with self._cv:
                read = rec.read = Future()
                self._reads.add(read)
            read.add_done_callback(self._read_done)
            rec.landed.add_done_callback(functools.partial(
                self._start_read, read, rec.tier, rec.pack.nbytes, rec.pack.device))

    def _start_read(self, read: Future, tier, nbytes: int, device: torch.device, landed: Future) -> None:
        """Where ``landed`` completed: start the read whose bytes (on ``device``) complete ``read``;
        the stored copy is freed once read, or failed."""
        from ..offload import Tier

        try:
            where = landed.result()
            if tier is not Tier.NVME:
                host = lend(self.store.view_of(where, Tier.HOST), nbytes, lambda: self._unregister(where))
                self._to_compute(read, host, device)
                return
            buf = self.pool.take(where.length)
            try:
                io = self.store.read_extent(where, buf[:where.length])
            except BaseException:
                self.pool.give(buf)
                self.store.free_extent(where)
                raise
        except BaseException as e:  # noqa: BLE001 - raised by the unpack that waits for it
            read.set_exception(e)
            return

        def arrived(f: Future) -> None:  # on the store's I/O thread that finished the read
            try:
                self.store.free_extent(where)
                f.result()  # the read's error, if any
            except BaseException as e:  # noqa: BLE001 - raised by the unpack; close() waits for the read
                self.pool.give(buf)
                read.set_exception(e)
                return
            self._to_compute(read, lend(buf, nbytes, lambda: self.pool.give(buf)), device)
        io.add_done_callback(arrived)

    def _to_compute(self, read: Future, host: torch.Tensor, device: torch.device) -> None:
        """Complete ``read`` with ``(tensor, copied event | None)`` on ``device``."""
        if not is_accelerator(device):
            read.set_result((host, None))
            return

        def copy() -> None:  # the HOST buffer goes back to the pool once the copy read it
            try:
                read.set_result(self._side.to_device(host, device))
            except BaseException as e:  # noqa: BLE001 - raised by the unpack that waits for it
                read.set_exception(e)
        # on the copy thread: a side-stream copy that it waits for, not the I/O or compute thread
        self._copier.submit(copy)

    def _read_done(self, read: Future) -> None:
        with self._cv:
            self._reads.discard(read)
            self._cv.notify_all()

    def _restore(self, rec: _Block, ref: PackedRef) -> torch.Tensor:
        if rec.base is None:
            self._prefetch(rec)  # not prefetched (unusual graph order): read now
            if not rec.read.done():
                t0 = time.perf_counter()
                rec.read.result()
                self.stats["stall_s"] += time.perf_counter() - t0
            base, copied = rec.read.result()
            if copied is not None:  # compute must not read the bytes before they land
                hand_to_compute(base, copied)
            # decoded on the compute thread (stream); the stored buffer goes back to the pool
            # (``landed`` goes too: its callbacks hold the read, and so the buffer)
            rec.base, rec.read, rec.landed = rec.pack.restore(base), None, None
        return BlockPack.view(rec.base, ref)

    def _discard(self, landed: Future, tier) -> None:
        """Free the stored bytes of a block whose graph went away without a backward."""
        from ..offload import Tier

        def drop(f: Future) -> None:
            if f.exception() is not None:
                return  # a failed write freed its extent already
            if tier is not Tier.NVME:
                self._unregister(f.result())
                return
            try:
                self.store.free_extent(f.result())
            except Exception:  # noqa: BLE001 - the store was closed first: it freed everything
                pass
        landed.add_done_callback(drop)

    # ------------------------------------------------------------------ helpers
    def _unregister(self, h) -> None:
        try:
            self.store.unregister(h)
        except Exception:  # noqa: BLE001 - the store was closed first: it freed everything
            pass

    def new_step(self) -> None:
        """Forget the previous step's blocks (their bytes live on in their graphs)."""
        self._blocks = {}

    def close(self) -> None:
        """Wait for transfers in flight, stop the copy thread, free the pooled buffers."""
        with self._cv:  # writes and reads complete on the store's I/O threads (and the copy thread)
            while self._inflight or self._reads:
                self._cv.wait()
        self._copier.shutdown(wait=True)
        self.pool.clear()
