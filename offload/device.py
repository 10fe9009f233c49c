"""The compute device: its choice, streams, events, copies and pinned memory (docs/architecture.md §7).

Every device-specific call of outcore lives here: streams, events, pinned memory, the compute
device's choice, and the runtime queries (the machine's GPUs, their memory and RNG state, the
process-group backend). Page-aligned host memory is ``aligned.py``'s; the store, the prefetcher
and the scheduler above it are the same code on every device. It is written against torch's
device-generic API (``torch.accelerator``, ``torch.Stream``, ``torch.Event``), so CUDA, ROCm
(which torch also calls ``cuda``) and the simulated accelerator the tests run on
(``offload/simdevice.py``, device type ``sim``) take one path; only registering existing host
memory as pinned is per backend.

- On an accelerator the DEVICE tier is device memory, the HOST tier is pinned RAM, and
  copies run on a side stream. Ordering is by events, never by luck: a copy *into* device
  memory waits for the compute work that was queued before the bytes it overwrites were
  freed (the CPU runs ahead of the device: kernels reading a freed slot may still be queued);
  a copy *out of* device memory waits for the compute work queued before it was issued
  (the bytes it reads may still be being written). A copy thread waits on the copy's event,
  so the caller gets an ordinary ``Future`` that completes when the bytes have landed.
- On a CPU-only machine the DEVICE tier is a RAM arena with its own budget, and copies
  into it are real copies done on a copy thread (``Tensor.copy_`` releases the GIL), so
  the overlap logic runs in every test.

Nothing here does device work at import time.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from .aligned import aligned_empty
from .modes import DEVICE_CHOICES


def cuda_available() -> bool:
    """True when torch sees a CUDA device (a cheap query; no context is created on CPU builds)."""
    return torch.cuda.is_available()


def resolve_device(kind: str | torch.device | None = "auto") -> torch.device:
    """The compute device ``--device`` names.

    Args:
        kind: ``auto`` (the GPU when there is one, else the CPU), ``cuda``, ``cpu``, ``sim``
            (the simulated accelerator: built and enabled now), or a ``torch.device``.

    Raises:
        ValueError: an unknown kind.
        RuntimeError: ``cuda`` without a CUDA device, or ``sim`` where it cannot be built.
    """
    if isinstance(kind, torch.device):
        return kind if kind.type == "cpu" or kind.index is not None else resolve_device(kind.type)
    kind = kind or "auto"
    if kind not in DEVICE_CHOICES:
        raise ValueError(f"device={kind!r}: choose one of {', '.join(DEVICE_CHOICES)}")
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    if kind == "cuda":
        if not cuda_available():
            raise RuntimeError("device=cuda but torch sees no CUDA device (a CPU-only torch build, or no driver); "
                               "use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "sim":
        from .simdevice import enable

        return torch.device(enable().type, 0)  # indexed, as its tensors' devices are
    return torch.device("cpu")


def is_accelerator(device: torch.device | None) -> bool:
    """Is ``device`` an accelerator with its own memory and streams (not the CPU, not meta)?"""
    return device is not None and device.type not in ("cpu", "meta")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or a dict / list / tuple of them) on ``device``.

    A blocking copy: the loader's batches are pageable memory, where an accelerator's
    ``non_blocking`` copy would be synchronous anyway (and a batch is a few KiB).
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@functools.lru_cache(maxsize=None)
def supports_sparse(device: torch.device) -> bool:
    """Can ``device`` hold sparse COO tensors (the embedding's row gradients,
    ``tied_embedding.py``)? CUDA and the CPU can; the simulated accelerator cannot, and
    its runs take autograd's dense embedding gradient instead (the same bits)."""
    try:
        with torch.sparse.check_sparse_tensor_invariants(enable=False):  # (no warning that they are off)
            torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long, device=device),
                                    torch.zeros(1, device=device), (1,), check_invariants=False)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def synchronize_device(device: torch.device) -> None:
    """Wait until all work queued on ``device`` is done (a host sync on an accelerator: the only
    way to time device work; nothing to wait for on CPU, where work runs as it is called)."""
    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def compute_event(device: torch.device | None) -> Any:
    """An event recorded on ``device``'s current (compute) stream, which a side stream can
    wait on to see everything computed so far; None off accelerators (work there is done)."""
    if not is_accelerator(device):
        return None
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


def host_wait(event: Any) -> None:
    """Block this thread until the work before ``event`` (from :func:`compute_event`) is done;
    None (off accelerators) has nothing to wait for. Another thread may queue work meanwhile."""
    if event is not None:
        event.synchronize()


def hand_to_compute(tensor: torch.Tensor, event: Any) -> None:
    """Let the compute stream of ``tensor``'s device use ``tensor``, made on a side stream
    whose copy ``event`` marks: compute waits for the event (on the device, not the host)
    and the caching allocator learns the tensor is used there."""
    stream = torch.accelerator.current_stream(tensor.device)
    stream.wait_event(event)
    tensor.record_stream(stream)


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` this thread's current stream of its device inside the block."""
    previous = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


class SideStreams:
    """One side stream per device, made on first use and shared by the I/O threads that copy
    on it, so copies overlap the compute stream. Each call blocks only its calling thread,
    until its copy is done."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()  # two I/O threads may ask for a stream first at once

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.Stream(device=device)
        return side

    def run_after(self, event: Any, device: torch.device, copy: Callable[[], Any]) -> None:
        """Queue ``copy()`` on ``device``'s side stream behind ``event`` (from
        :func:`compute_event`), then wait for the side stream (this thread only).

        Args:
            event: what the copy must see computed first.
            device: the accelerator.
            copy: queues the copy (e.g. a ``non_blocking`` device -> pinned HOST copy).
        """
        side = self._stream(device)
        side.wait_event(event)
        with _on_stream(side):
            copy()
        side.synchronize()

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """``host`` copied into a new tensor on ``device`` on its side stream; returns once the
        copy has read ``host`` (so its buffer may be reused).

        Returns:
            ``(tensor, event)``: pass both to :func:`hand_to_compute` before computing with it.
        """
        side = self._stream(device)
        with _on_stream(side):
            out = torch.empty(host.shape, dtype=host.dtype, device=device)
            out.copy_(host, non_blocking=True)
            copied = torch.Event(device=device)
            copied.record(side)
        copied.synchronize()
        return out, copied


def _register_host(device: torch.device, t: torch.Tensor) -> Callable[[], None]:
    """Pin ``t``'s memory (page-aligned) for DMA with ``device``'s runtime; returns the unregister.

    Registering memory we allocated page-aligned (rather than ``torch.empty(pin_memory=True)``)
    keeps the slab its own size: torch's host caching allocator rounds every pinned block up
    to a power of two and keeps it for the life of the process (a 40 GiB HOST tier would pin
    64 GiB, never given back).

    Raises:
        RuntimeError: the runtime refused (e.g. the pinned-memory limit, ``ulimit -l``).
    """
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if device.type == "cuda":
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**20:.1f} MiB of HOST memory failed "
                               f"(error {int(err)}): lower --host-mem, or raise the locked-memory limit (ulimit -l)")
        return lambda: cudart.cudaHostUnregister(ptr)
    if device.type == "sim":
        from . import simdevice

        simdevice.host_register(t)
        return lambda: simdevice.host_unregister_ptr(ptr)  # (a closure over `t` would keep it alive)
    raise RuntimeError(f"pinning HOST memory for a {device.type!r} device is not supported")


def pinned_empty(device: torch.device, nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 HOST buffer of ``align_up(nbytes)`` bytes, pinned for ``device``'s
    DMA and unpinned when its last view is gone (the memory stays mapped until then)."""
    # A numpy array in between: its weak reference is cleared *before* it lets go of the
    # mapping, so the runtime unregisters memory that is still mapped.
    arr = aligned_empty(nbytes).numpy()
    unregister = _register_host(device, torch.from_numpy(arr))
    weakref.finalize(arr, unregister)
    return torch.from_numpy(arr)


class Device:
    """The compute device as the tiered store sees it.

    Args:
        kind: ``"auto"`` / None (the GPU when there is one), ``"cuda"``, ``"cpu"``, ``"sim"``,
            or a ``torch.device``.
        index: CUDA device index (None: the current one, this rank's under torchrun).
    """

    def __init__(self, kind: str | torch.device | None = None, index: int | None = None):
        if isinstance(kind, str) and kind == "cuda" and index is not None:
            kind = torch.device("cuda", index)
        self.torch_device = resolve_device(kind)
        self.kind = self.torch_device.type
        self._side: Any = None  # the copy stream, made on first use (never at import)
        self._freed: Any = None  # compute event recorded at the newest DEVICE free
        self._lock = threading.Lock()
        # One copy thread: transfers HOST<->DEVICE are serialized like a DMA engine.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outcore-copy")
        # The stream compute runs on: this thread's current one now (the default stream).
        # I/O threads that start copies read it from here, not from their own thread state.
        self._compute = torch.accelerator.current_stream(self.torch_device) if self.is_accelerator else None

    @property
    def is_accelerator(self) -> bool:
        """Device memory of its own, copies on streams (not the CPU's RAM arena)."""
        return is_accelerator(self.torch_device)

    def alloc_device_slab(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer ``[nbytes]`` in DEVICE memory (a populated RAM arena slab on CPU)."""
        if self.is_accelerator:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        return aligned_empty(nbytes)

    def alloc_host_slab(self, nbytes: int) -> torch.Tensor:
        """A 4 KiB-aligned uint8 HOST buffer ``[>= nbytes]``: pinned on an accelerator (DMA),
        plain RAM on CPU."""
        if self.is_accelerator:
            return pinned_empty(self.torch_device, nbytes)
        return aligned_empty(nbytes)

    def note_free(self) -> None:
        """A DEVICE block was freed: later copies into DEVICE memory wait for the compute work
        queued until now, which may still read it. (Events on one stream complete in order, so
        the newest covers every earlier free.)"""
        if self.is_accelerator:
            event = torch.Event(device=self.torch_device)
            event.record(self._compute)
            with self._lock:
                self._freed = event

    def note_host_free(self, block: torch.Tensor) -> None:
        """A HOST block (a staging copy, say) was freed: on the simulated accelerator its bytes
        are poisoned, as its freed device memory is, so a reader that outlived the release reads
        NaNs there (elsewhere nothing: a real runtime reuses the memory silently)."""
        if self.kind == "sim":
            block.fill_(0xFF)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> Future:
        """Copy ``src`` into ``dst`` (same shape) off the calling thread.

        Returns:
            A Future that completes when the bytes are in ``dst`` and any stream
            may read them.
        """
        if not self.is_accelerator:
            return self._copier.submit(dst.copy_, src)
        if dst.device.type == self.kind:  # into DEVICE memory: after its previous readers
            with self._lock:
                after = self._freed
        else:  # out of DEVICE memory: after the compute that wrote it, queued before now
            after = torch.Event(device=self.torch_device)
            after.record(self._compute)
        return self._copier.submit(self._copy_on_side, dst, src, after)

    def _copy_on_side(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> torch.Tensor:
        if self._side is None:
            self._side = torch.Stream(device=self.torch_device)
        if after is not None:
            self._side.wait_event(after)
        with _on_stream(self._side):
            dst.copy_(src, non_blocking=True)
        done = torch.Event(device=self.torch_device)
        done.record(self._side)
        # Host wait on the copy thread (not the caller): completing the Future must
        # mean the copy is done, so consumers on any stream may use `dst`.
        done.synchronize()
        return dst

    def synchronize(self) -> None:
        """Wait for all queued copies (and, on an accelerator, all device work)."""
        self._copier.submit(lambda: None).result()
        synchronize_device(self.torch_device)

    def memory_allocated(self) -> int:
        """Bytes torch holds on the device now (0 on CPU: the arena is counted by the store)."""
        return int(torch.accelerator.memory_allocated(self.torch_device)) if self.kind == "cuda" else 0

    def close(self) -> None:
        self._copier.shutdown(wait=True)


# ------------------------------------------------- the machine's GPUs, memory, RNG state, process-group backend

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


def device_memory(device: torch.device | None = None) -> dict[str, int]:
    """``{"device_bytes", "device_total_bytes"}`` of the CUDA ``device`` (default: the current
    one, this rank's under torchrun) for StepEvent; ``{}`` elsewhere."""
    if not cuda_available() or (device is not None and device.type != "cuda"):
        return {}
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return {"device_bytes": int(torch.cuda.memory_allocated(index)),
            "device_total_bytes": int(torch.cuda.get_device_properties(index).total_memory)}


def free_device_bytes(device: torch.device) -> int:
    """Free bytes on an accelerator ``device`` (a host sync point: call it rarely)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free, _ = torch.accelerator.get_memory_info(device)
    return int(free)


def rng_state(device: torch.device | None) -> torch.Tensor | None:
    """The RNG state of the compute ``device`` alone (for checkpoints); None on the CPU (whose
    state is saved apart). One device's only: a run resumed on a machine with another number
    of GPUs restores it all the same."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def set_rng_state(device: torch.device | None, state: Any) -> None:
    """Restore what :func:`rng_state` captured. A checkpoint of an older layout holds a list
    (every GPU's state): its entry for this device is taken, when there is one."""
    if state is None or device is None or device.type != "cuda":
        return
    if isinstance(state, (list, tuple)):
        index = device.index or 0
        if index >= len(state):
            return
        state = state[index]
    torch.cuda.set_rng_state(state, device)


def distributed_backend(device: torch.device | str | None = None) -> str:
    """The torch.distributed backend for ``device`` (a device or a ``--device`` kind; default:
    this machine's): nccl on CUDA, ``simgloo`` on the simulated accelerator (``simdist.py``:
    its tensors through CPU copies over gloo, CPU tensors over gloo; registered now), else gloo."""
    kind = device.type if isinstance(device, torch.device) else (device or "auto")
    if kind == "sim":
        from .simdist import NAME, register

        register()
        return NAME
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    return "nccl" if kind == "cuda" else "gloo"


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
