"""Saved-tensor offload through the tiered store, prefetched ahead of the backward.

Inside an offloaded block's forward a ``saved_tensors_hooks`` pack hook sees
every tensor autograd saves. Large ones that are not parameters are handed to
a writer thread that registers them in the :class:`~outcore.offload.TieredStore`
(``home=HOST`` or ``home=NVME``: the store's budgets and checksummed O_DIRECT
extents apply) and then drops the device copy. Small tensors and parameters
(or views of them) go to the *outer* hooks unchanged, so this composes with the
out-of-core engine's own pack hook for weights.

Backward visits blocks in reverse (the known future): when the gradient of
block ``i``'s output appears, reads of blocks ``i .. i-depth`` are queued on
reader threads (``store.load`` for NVME, a copy from the HOST arena), and on
CUDA copied to the device on a side stream. The unpack hook waits only for
what has not arrived yet.

Memory bound: writes in flight hold their source tensor; at most
``max_inflight_bytes`` of them are outstanding, after which a pack waits
(backpressure: the forward cannot outrun the disk without bound).
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from .policy import ActivationPolicy

_MIN_BYTES = 256 << 10  # smaller saved tensors stay put: their I/O would cost more than they hold


class _Saved:
    """One offloaded tensor: its store handle and the read/write futures."""

    __slots__ = ("owner", "block", "handle", "write", "read", "tensor", "nbytes", "device", "__weakref__")

    def __init__(self, owner: "ActivationOffloader", block: int, nbytes: int, device: torch.device):
        self.owner, self.block, self.nbytes, self.device = owner, block, nbytes, device
        self.handle = None
        self.write: Future | None = None
        self.read: Future | None = None
        self.tensor: torch.Tensor | None = None  # the restored tensor, once unpacked

    def __del__(self):  # the graph was freed (after backward, or without one): drop the bytes
        owner = self.owner
        if owner is not None and self.tensor is None:
            owner._discard(self)


class ActivationOffloader:
    """Moves the saved activations of chosen blocks to HOST or NVME and back.

    Args:
        store: the :class:`~outcore.offload.TieredStore` whose HOST / NVME tiers hold
            the offloaded bytes (with a swap dir for NVME).
        min_bytes: saved tensors smaller than this stay where they are.
        prefetch_depth: blocks read ahead of the one whose backward starts.
        max_inflight_bytes: bytes of writes in flight before a pack waits.
        io_threads: reader threads (one writer thread keeps writes in order).
    """

    def __init__(self, store: Any, *, min_bytes: int = _MIN_BYTES, prefetch_depth: int = 2,
                 max_inflight_bytes: int = 256 << 20, io_threads: int = 2):
        if prefetch_depth < 0 or max_inflight_bytes <= 0 or io_threads < 1:
            raise ValueError(f"prefetch_depth={prefetch_depth}, max_inflight_bytes={max_inflight_bytes}, "
                             f"io_threads={io_threads}: need >= 0, > 0 and >= 1")
        self.store = store
        self.min_bytes = int(min_bytes)
        self.prefetch_depth = int(prefetch_depth)
        self.max_inflight = int(max_inflight_bytes)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="outcore-act-w")
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="outcore-act-r")
        self._cv = threading.Condition()
        self._inflight = 0
        self._keys = itertools.count()
        # Per block, in pack order (this step). Weak: the autograd graph owns each _Saved,
        # so a graph dropped without a backward frees its stored bytes (_Saved.__del__).
        self._blocks: dict[int, list[weakref.ref]] = {}
        self._side = None  # CUDA side stream, created on first CUDA use
        self.stats = {"offloaded_bytes": 0, "kept_bytes": 0, "stall_s": 0.0, "tensors": 0}

    # ------------------------------------------------------------------ forward
    @contextmanager
    def block(self, index: int, policy: ActivationPolicy, module: nn.Module) -> Iterator[None]:
        """Offload what ``module`` (block ``index``) saves while the context is open."""
        from ..offload import Tier

        tier = Tier.HOST if policy is ActivationPolicy.OFFLOAD_HOST else Tier.NVME
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._blocks[index] = []

        def pack(t: torch.Tensor) -> Any:
            base = t._base if t._base is not None else t
            nbytes = t.numel() * t.element_size()
            if (nbytes < self.min_bytes or isinstance(base, nn.Parameter)
                    or t.untyped_storage().data_ptr() in params or t.is_sparse):
                self.stats["kept_bytes"] += nbytes
                return ("outer", outer_pack(t) if outer_pack is not None else t)
            return self._offload(index, t, tier)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, tuple):
                return outer_unpack(packed[1]) if outer_unpack is not None else packed[1]
            return self._restore(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _offload(self, index: int, t: torch.Tensor, tier) -> _Saved:
        nbytes = t.numel() * t.element_size()
        saved = _Saved(self, index, nbytes, t.device)
        self._blocks[index].append(weakref.ref(saved))
        with self._cv:  # backpressure: bounded bytes waiting for the disk
            while self._inflight and self._inflight + nbytes > self.max_inflight:
                self._cv.wait()
            self._inflight += nbytes
        ready = None
        if t.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # the writer's side stream must see t fully computed
        src = t.detach()
        key = f"act{next(self._keys)}.b{index}"
        self.stats["offloaded_bytes"] += nbytes
        self.stats["tensors"] += 1
        saved.write = self._writer.submit(self._write, key, src, tier, ready)
        return saved

    def _write(self, key: str, src: torch.Tensor, tier, ready) -> Any:
        try:
            data = src if src.is_contiguous() else src.contiguous()
            if ready is not None:
                # D2H on a side stream after the producer's event; copy_ to host blocks
                # this thread (not the compute stream) until the bytes are on the host.
                side = self._side_stream()
                side.wait_event(ready)
                with torch.cuda.stream(side):
                    data = data.to("cpu")
            return self.store.register(key, data=data, home=tier)
        finally:
            with self._cv:
                self._inflight -= src.numel() * src.element_size()
                self._cv.notify_all()

    # ----------------------------------------------------------------- backward
    def backward_reached(self, index: int) -> None:
        """Block ``index``'s backward begins: queue reads of it and the next blocks down."""
        for j in range(index, index - 1 - self.prefetch_depth, -1):
            for ref in reversed(self._blocks.get(j, ())):
                saved = ref()
                if saved is not None:
                    self._prefetch(saved)

    def _prefetch(self, saved: _Saved) -> None:
        if saved.read is None and saved.tensor is None:
            saved.read = self._readers.submit(self._read, saved)

    def _read(self, saved: _Saved):
        from ..offload import Tier

        h = saved.write.result()  # the write must have landed (usually long done)
        try:
            if h.home is Tier.NVME:
                host = self.store.load(h)  # fresh aligned buffer: no extra copy on CPU
            else:
                host = self.store.view_of(h, Tier.HOST)
                if saved.device.type == "cpu":
                    host = host.clone()  # the arena bytes are freed with the handle
            if saved.device.type == "cuda":
                side = self._side_stream()
                with torch.cuda.stream(side):
                    out = host.to(saved.device, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                done.synchronize()  # the HOST bytes may be freed only after the copy
                return out, done
            return host, None
        finally:
            self.store.unregister(h)

    def _restore(self, saved: _Saved) -> torch.Tensor:
        if saved.tensor is not None:
            return saved.tensor
        self._prefetch(saved)  # not prefetched (unusual graph order): read now
        if not saved.read.done():
            t0 = time.perf_counter()
            out, done = saved.read.result()
            self.stats["stall_s"] += time.perf_counter() - t0
        else:
            out, done = saved.read.result()
        if done is not None:
            stream = torch.cuda.current_stream(saved.device)
            stream.wait_event(done)  # compute must not read the bytes before they land
            out.record_stream(stream)
        saved.tensor = out
        saved.read = None
        return out

    def _discard(self, saved: _Saved) -> None:
        """Free the stored bytes of a tensor whose graph went away without unpacking it."""
        write, read = saved.write, saved.read
        saved.owner = None
        if read is not None or write is None:
            return  # the read unregisters the handle itself

        def drop():
            try:
                self.store.unregister(write.result())
            except Exception:  # noqa: BLE001 - a failed write has nothing to free
                pass
        try:
            self._writer.submit(drop)
        except RuntimeError:  # shut down: close() frees everything with the store
            pass

    # ------------------------------------------------------------------ helpers
    def _side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def new_step(self) -> None:
        """Forget the previous step's block lists (their tensors live on in their graphs)."""
        self._blocks = {}

    def close(self) -> None:
        """Wait for transfers in flight and stop the I/O threads."""
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
