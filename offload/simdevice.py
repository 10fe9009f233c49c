"""A simulated accelerator, ``torch.device("sim")``, that fails where a GPU fails.

CI has no GPU, so outcore's GPU path (device buffers, side streams, pinned copies) would
otherwise never run there. ``offload/csrc/simdevice.cpp`` is PyTorch's PrivateUse1 backend,
renamed ``sim``: real tensors with their own dispatch key and device memory, streams and
events, reached through the generic APIs (``torch.accelerator``, ``torch.Stream``,
``torch.Event``, ``Tensor.to("sim")``, ``record_stream``, ``pin_memory``)::

    simdevice.load()          # early (at import): before the process's first backward pass
    dev = simdevice.enable()  # torch.device("sim"), now the current accelerator

It is built on first use with ``torch.utils.cpp_extension.load`` (through ``kernels/_jit.py``; ninja; ~25 s on 2 cores,
then cached in ``TORCH_EXTENSIONS_DIR``).

Every op runs the CPU kernel on CPU tensors aliasing the device memory, so results are
bit-identical to the CPU's. The simulation is in what a GPU does differently:

* device memory is not zeroed: new and freed device memory reads 0xFF (NaN in fp32/bf16/fp16);
* a ``non_blocking`` copy between the device and pinned host memory lands late: its
  destination holds poison until ordering forces the copy (its stream synchronized, an event
  after it synchronized, queried or waited on by another stream, a later op on its stream
  touching its bytes, a device synchronize); a host buffer changed before then gives the
  copy the new bytes. A ``non_blocking`` copy with pageable host memory runs at once (CUDA
  stages it synchronously) and is counted in ``report()["pageable_non_blocking"]``;
* a race detector: two streams touching the same 4 KiB of a device allocation, one of them
  writing, with no event (or host synchronization) ordering them, raise ``RuntimeError``
  naming both streams, the ops and the bytes (on a GPU: silent corruption when the host runs
  ahead, which it does);
* freed device memory is poisoned and reused by its allocation stream, unless
  ``record_stream`` marked a use on another stream (then it is kept until the work that
  stream had issued at free time has run); a queued copy whose memory was freed raises
  ``use after free`` when it runs;
* mixing sim tensors with CPU tensors of dim >= 1 raises CUDA's ``Expected all tensors to be
  on the same device``; 0-dim CPU scalars, copies and CPU index tensors are allowed, as there;
* collectives: :func:`enable` registers sim's ``torch.distributed`` backend, ``simgloo``
  (``offload/simdist.py``: gloo underneath, sim tensors staged through CPU copies on the current
  stream), which refuses what NCCL refuses (CPU and device tensors in one collective);
* random ops draw from the CPU default generator: ``torch.manual_seed`` seeds them, and a
  seeded sim run gives the CPU's numbers. ``torch.optim`` picks foreach kernels for sim, as
  for CUDA (the CPU default is the single-tensor loop).

Known gaps: one device; no autocast; the race granule is 4 KiB (two streams writing disjoint
bytes of one granule are reported); ops with data-dependent output sizes (``nonzero``) do not
synchronize the host as CUDA's do; a pinned ``non_blocking`` copy whose device side is not
contiguous runs at once instead of late; at most 8 streams exist (the 7 side streams are
handed out round-robin, as CUDA's pool of 32 is).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import threading
import types
from pathlib import Path

import torch

NAME = "sim"
_REPORT_KEYS = ("kernels", "pageable_non_blocking", "deferred_copies", "bytes_h2d", "bytes_d2h",
                "allocated_bytes", "peak_bytes", "pending_copies")
_lock = threading.Lock()
_loaded = False
_device: torch.device | None = None


@functools.lru_cache(maxsize=1)
def _missing() -> str | None:
    """What building the extension lacks here (None: nothing)."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"a C++ compiler ({cxx!r} is not on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja"
    return None


def available() -> bool:
    """True when :func:`load` can build the backend here (a compiler and ninja; no build)."""
    return _loaded or _missing() is None


def load() -> None:
    """Build (first use only) and load the backend without naming it: nothing visible changes.

    Torch's autograd engine counts the devices once, at the first backward pass of the
    process, and gives each device type its own thread; a backend loaded after that has no
    thread, and backward on it fails. So code that will use sim later, after other work may
    have run a backward pass (a test module in a pytest session), calls load() early, e.g.
    at import; :func:`enable` does the rest when sim is needed. Idempotent.

    Raises:
        RuntimeError: the extension cannot be built here (one line naming what is missing).
    """
    global _loaded
    with _lock:
        if _loaded:
            return
        if (missing := _missing()) is not None:
            raise RuntimeError(f"outcore sim device: cannot build the extension: no {missing}")
        from ..kernels._jit import load_extension

        src = Path(__file__).with_name("csrc") / "simdevice.cpp"
        try:
            load_extension("outcore_simdevice", sources=[str(src)], extra_cflags=["-O2"],
                           is_python_module=False, verbose=False)
        except Exception as exc:  # a compiler's output is long: name its first error
            lines = str(exc).splitlines() or [type(exc).__name__]
            first = next((ln for ln in lines if "error" in ln and not ln.startswith("c++ ")), lines[0])
            raise RuntimeError(f"outcore sim device: building {src.name} failed: {first.strip()}") from exc
        _loaded = True


def enable() -> torch.device:
    """Register the ``sim`` device (idempotent; :func:`load` first if needed).

    Renames PrivateUse1 to ``sim``, adds ``Tensor.sim()`` / ``Tensor.is_sim`` and friends, and
    the ``torch.sim`` module ``torch.accelerator`` asks: from then on sim is the process's
    current accelerator.

    Returns:
        ``torch.device("sim")``.

    Raises:
        RuntimeError: it cannot be built here; another PrivateUse1 backend is registered; or
            the autograd engine started before :func:`load` (see there).
    """
    global _device
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        raise RuntimeError(f"outcore sim device: PrivateUse1 is already taken by {current!r}")
    load()
    with _lock:
        if _device is None:
            if current != NAME:
                torch.utils.rename_privateuse1_backend(NAME)
            if not hasattr(torch, NAME):
                torch._register_device_module(NAME, _device_module())
            if not hasattr(torch.Tensor, f"is_{NAME}"):
                torch.utils.generate_methods_for_privateuse1_backend()
            torch.ops.outcore_sim.init()
            _check_autograd()
            from .simdist import register  # its collectives: the "simgloo" process-group backend

            register()
            _device = torch.device(NAME)
    return _device


def _check_autograd() -> None:
    x = torch.zeros((), device=NAME, requires_grad=True)
    try:
        x.sum().backward()
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise RuntimeError("outcore sim device: it was loaded after this process's first backward pass, "
                           "so the autograd engine has no thread for it; call "
                           "outcore.offload.simdevice.load() earlier (e.g. at import)") from None


def _device_module() -> types.ModuleType:
    """``torch.sim``: what ``torch.accelerator`` and ``torch.manual_seed`` ask the backend."""
    mod = types.ModuleType(f"torch.{NAME}")

    def set_device(device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(f"there is one sim device (sim:0); got index {index}")

    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    # torch's device_lazy_init marks a PrivateUse1 backend initialized only after calling
    # its module's _lazy_init; until then torch.accelerator.synchronize() is a no-op (2.11)
    mod._lazy_init = lambda: None
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.set_device = set_device
    mod.synchronize = lambda device=None: torch.accelerator.synchronize()
    mod.current_stream = lambda device=None: torch.accelerator.current_stream()
    # What code that drives "the accelerator" through its module uses (DCP's staging, once sim
    # is the process's accelerator): streams and events are torch's generic ones.
    mod.Stream = lambda device=None, priority=0: torch.Stream(device=NAME, priority=priority)
    mod.Event = lambda enable_timing=False, **_: torch.Event(device=NAME, enable_timing=enable_timing)
    mod.stream = _stream_context
    mod._is_in_bad_fork = lambda: False
    # Sim ops draw from the CPU generator, which torch.manual_seed has already seeded; its state
    # is the CPU's (what torch.utils.checkpoint and AOT dispatch save and restore per device).
    mod.manual_seed = mod.manual_seed_all = lambda seed: None
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.get_rng_state_all = lambda: [torch.get_rng_state()]
    mod.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    mod.memory_allocated = lambda device=None: report()["allocated_bytes"]
    mod.max_memory_allocated = lambda device=None: report()["peak_bytes"]
    mod.empty_cache = lambda: torch.ops.outcore_sim.empty_cache()
    # Autocast: none (a known gap). torch.utils.checkpoint's recompute asks for the forward's
    # state (off) on every device type it saw; turning it on is refused, never ignored.
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    mod.is_autocast_enabled = lambda: False
    mod.get_autocast_dtype = lambda: torch.bfloat16

    def set_autocast_enabled(enabled: bool) -> None:
        if enabled:
            raise NotImplementedError("the sim device has no autocast: cast the model (dtype=bfloat16) instead")

    mod.set_autocast_enabled = set_autocast_enabled
    mod.set_autocast_dtype = lambda dtype: None
    return mod


@contextlib.contextmanager
def _stream_context(stream):
    """``torch.sim.stream(s)``: ``s`` is this thread's current sim stream inside (None: no change)."""
    if stream is None:
        yield
        return
    previous = torch.accelerator.current_stream()
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


def report() -> dict[str, int]:
    """Counters since :func:`reset_report` and memory now.

    ``kernels`` (ops run on the device), ``pageable_non_blocking`` (``non_blocking`` copies a
    GPU would run synchronously: pageable host memory, or a host-side dtype/layout change; a
    performance bug, not an error), ``deferred_copies`` (copies that landed late),
    ``bytes_h2d`` / ``bytes_d2h``, ``allocated_bytes`` (live device memory; pool blocks are
    rounded up to 4 KiB) and ``peak_bytes`` (its high-water mark), ``pending_copies`` (queued
    copies not run yet).
    """
    enable()
    return dict(zip(_REPORT_KEYS, torch.ops.outcore_sim.report()))


def reset_report() -> None:
    """Zero the counters of :func:`report`; the peak restarts from the memory in use."""
    enable()
    torch.ops.outcore_sim.reset_report()


def host_register(t: torch.Tensor) -> None:
    """Pin ``t``'s memory for the sim device (``cudaHostRegister``): ``t.is_pinned()`` is then
    True and ``non_blocking`` copies from or to it are asynchronous.

    Raises:
        RuntimeError: ``t`` is not a contiguous CPU tensor starting on a page boundary, or its
            pages overlap memory already pinned or registered.
    """
    enable()
    torch.ops.outcore_sim.host_register(t)


def host_unregister(t: torch.Tensor) -> None:
    """Undo :func:`host_register` (``t`` must start where a registered range starts)."""
    enable()
    torch.ops.outcore_sim.host_unregister(t)


def host_unregister_ptr(ptr: int) -> None:
    """:func:`host_unregister` of the range that starts at address ``ptr``: for a finalizer,
    which must not hold the tensor it outlives."""
    host_unregister(torch.frombuffer((ctypes.c_char * 1).from_address(ptr), dtype=torch.uint8))


def unavailable_reason() -> str | None:
    """Why the backend cannot be built here (None: it can)."""
    return None if available() else _missing()
