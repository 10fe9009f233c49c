"""Every device-specific call of outcore lives here (docs/architecture.md §7).

``torch.cuda``, streams, events, pinned memory and kvikio are touched only in
this module; the store, the prefetcher and the scheduler above it are the same
code on CUDA and on CPU.

- On a CUDA machine the DEVICE tier is device memory, the HOST tier is pinned
  RAM, and copies run on a side stream; a copy thread waits on the stream's
  event so the caller gets an ordinary ``Future``.
- On a CPU-only machine the DEVICE tier is a RAM arena with its own budget,
  and copies into it are real copies done on a copy thread (``Tensor.copy_``
  releases the GIL), so the overlap logic runs in every test.

Nothing here does CUDA work at import time.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from .directio import aligned_empty


def cuda_available() -> bool:
    """True when torch sees a CUDA device (a cheap query; no context is created on CPU builds)."""
    return torch.cuda.is_available()


def list_devices() -> list[dict]:
    """The CUDA devices: ``[{"name", "total_bytes", "free_bytes"}]``; ``[]`` on CPU."""
    if not cuda_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append({"name": torch.cuda.get_device_name(i), "total_bytes": int(total),
                    "free_bytes": int(free)})
    return out


def cuda_rng_state() -> list[torch.Tensor] | None:
    """Every CUDA device's RNG state (for checkpoints); None without CUDA."""
    return torch.cuda.get_rng_state_all() if cuda_available() else None


def set_cuda_rng_state(state: list[torch.Tensor] | None) -> None:
    """Restore what :func:`cuda_rng_state` captured (nothing without CUDA or state)."""
    if state is not None and cuda_available():
        torch.cuda.set_rng_state_all(state)


def device_memory() -> dict[str, int]:
    """``{"device_bytes", "device_total_bytes"}`` of CUDA device 0 (for StepEvent); ``{}`` on CPU."""
    if not cuda_available():
        return {}
    return {"device_bytes": int(torch.cuda.memory_allocated()),
            "device_total_bytes": int(torch.cuda.get_device_properties(0).total_memory)}


def free_device_bytes(device: torch.device) -> int:
    """Free bytes on a CUDA ``device`` (a host sync point: call it rarely)."""
    return int(torch.cuda.mem_get_info(device)[0])


def synchronize_device(device: torch.device) -> None:
    """Wait until all work queued on ``device`` is done (a host sync on CUDA: the only way
    to time device work; nothing to wait for on CPU, where work runs as it is called)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_event(device: torch.device | None) -> Any:
    """An event recorded on ``device``'s current (compute) stream, which a side stream can
    wait on to see everything computed so far; None off CUDA (work there is already done)."""
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def hand_to_compute(tensor: torch.Tensor, event: Any) -> None:
    """Let the compute stream of ``tensor``'s device use ``tensor``, made on a side stream
    whose copy ``event`` marks: compute waits for the event (on the device, not the host)
    and the caching allocator learns the tensor is used there."""
    stream = torch.cuda.current_stream(tensor.device)
    stream.wait_event(event)
    tensor.record_stream(stream)


class SideStreams:
    """One CUDA side stream per device, made on first use and shared by the I/O threads
    that copy on it, so copies overlap the compute stream. Each call blocks only its
    calling thread, until its copy is done."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()  # two I/O threads may ask for a stream first at once

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device=device)
        return side

    def run_after(self, event: Any, device: torch.device, copy: Callable[[], Any]) -> None:
        """Queue ``copy()`` on ``device``'s side stream behind ``event`` (from
        :func:`compute_event`), then wait for the side stream (this thread only).

        Args:
            event: what the copy must see computed first.
            device: the CUDA device.
            copy: queues the copy (e.g. a ``non_blocking`` device -> pinned HOST copy).
        """
        side = self._stream(device)
        side.wait_event(event)
        with torch.cuda.stream(side):
            copy()
        side.synchronize()

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """``host`` copied into a new tensor on ``device`` on its side stream; returns once the
        copy has read ``host`` (so its buffer may be reused).

        Returns:
            ``(tensor, event)``: pass both to :func:`hand_to_compute` before computing with it.
        """
        with torch.cuda.stream(self._stream(device)):
            out = torch.empty(host.shape, dtype=host.dtype, device=device)
            out.copy_(host, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        copied.synchronize()
        return out, copied


def distributed_backend() -> str:
    """The torch.distributed backend for this machine: nccl with CUDA, else gloo."""
    return "nccl" if cuda_available() else "gloo"


def use_local_device(local_rank: int) -> None:
    """Make GPU ``local_rank`` this process's current CUDA device (nothing without CUDA).

    Every rank on a machine otherwise lands on GPU 0: NCCL needs one GPU per rank, and the
    store's DEVICE tier (``Device()``) takes the current device. Called before the process
    group is made, so NCCL's communicator binds to the same GPU.

    Raises:
        RuntimeError: more ranks on this machine than GPUs.
    """
    if not cuda_available():
        return
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this machine has {count} GPU(s): "
                           f"launch at most {count} processes per node (torchrun --nproc-per-node {count})")
    torch.cuda.set_device(local_rank)


class Device:
    """The compute device as the tiered store sees it.

    Args:
        kind: ``"cuda"``, ``"cpu"`` or ``None`` (CUDA when available).
        index: CUDA device index (None: the current one, this rank's under torchrun).
    """

    def __init__(self, kind: str | None = None, index: int | None = None):
        kind = kind or ("cuda" if cuda_available() else "cpu")
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"device kind {kind!r} must be 'cuda' or 'cpu'")
        if kind == "cuda" and not cuda_available():
            raise RuntimeError("device kind 'cuda' asked for but torch sees no CUDA device")
        if kind == "cuda" and index is None:
            index = torch.cuda.current_device()
        self.kind = kind
        self.torch_device = torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")
        self._stream = None  # side stream for copies, created on first use (never at import)
        # One copy thread: transfers HOST<->DEVICE are serialized like a DMA engine.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outcore-copy")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def alloc_device_slab(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer ``[nbytes]`` in DEVICE memory (a populated RAM arena slab on CPU)."""
        if self.is_cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        return aligned_empty(nbytes)

    def alloc_host_slab(self, nbytes: int) -> torch.Tensor:
        """A 4 KiB-aligned uint8 HOST buffer ``[>= nbytes]``: pinned on CUDA (fast DMA), plain RAM on CPU.

        Pinning is only attempted on CUDA: CPU-only torch raises on ``pin_memory``.
        """
        if self.is_cuda:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            if t.data_ptr() % 4096 == 0:
                return t
            # cudaHostAlloc is page-aligned in practice; fall back rather than break O_DIRECT
            t = aligned_empty(nbytes)
            torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
            return t
        return aligned_empty(nbytes)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> Future:
        """Copy ``src`` into ``dst`` (same shape) off the calling thread.

        Returns:
            A Future that completes when the bytes are in ``dst`` and any stream
            may read them.
        """
        if self.is_cuda:
            return self._copier.submit(self._copy_cuda, dst, src)
        return self._copier.submit(dst.copy_, src)

    def _copy_cuda(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.torch_device)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        # Host wait on the copy thread (not the caller): completing the Future must
        # mean the copy is done, so consumers on any stream may use `dst`.
        ev.synchronize()
        return dst

    def synchronize(self) -> None:
        """Wait for all queued copies (and, on CUDA, all device work)."""
        self._copier.submit(lambda: None).result()
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def memory_allocated(self) -> int:
        """Bytes torch holds on the device now (0 on CPU: the arena is counted by the store)."""
        return int(torch.cuda.memory_allocated(self.torch_device)) if self.is_cuda else 0

    def close(self) -> None:
        self._copier.shutdown(wait=True)


def measure_copy_gbps(device: Device | None = None, nbytes: int = 64 << 20,
                      seconds: float = 0.5) -> tuple[float, float]:
    """Host->device and device->host copy bandwidth (GB/s, 1e9 bytes).

    On CPU both directions are RAM-arena copies (what a DEVICE fetch costs there).

    Args:
        device: the device (default: ``Device()``).
        nbytes: size of one copy.
        seconds: time budget per direction (at least 3 copies are timed).

    Returns:
        ``(h2d_gbps, d2h_gbps)``, medians over the timed copies.
    """
    dev = device or Device()
    host, dslab = dev.alloc_host_slab(nbytes), dev.alloc_device_slab(nbytes)
    host, dslab = host[:nbytes], dslab[:nbytes]

    def run(dst, src) -> float:
        dev.copy_async(dst, src).result()  # warm-up
        times, t_end = [], time.perf_counter() + seconds
        while len(times) < 3 or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            dev.copy_async(dst, src).result()
            times.append(time.perf_counter() - t0)
        times.sort()
        return nbytes / times[len(times) // 2] / 1e9

    h2d, d2h = run(dslab, host), run(host, dslab)
    if device is None:
        dev.close()
    return h2d, d2h
