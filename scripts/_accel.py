"""The device a GPU-proof benchmark runs on, and how to time work on it honestly.

Shared by ``bench_kernels.py`` and ``bench_peers.py`` (and free for ``bench_gpu_step.py``);
scripts/ is not a package, so they import it with scripts/ on ``sys.path``.

``--device`` takes ``auto | cuda | sim | cpu``:

* ``cuda``: the GPU; refused in one line where ``torch.cuda.is_available()`` is False.
* ``sim``: the simulated accelerator, a PrivateUse1 backend that
  ``outcore.offload.simdevice.enable()`` registers. Until that module exists (or where it fails
  to enable) the run falls back to the CPU and says so in ``Device.note``: a dry run then still
  tests the harness, and its JSON never claims a device it did not use.
* ``cpu``: the CPU.
* ``auto``: cuda if there is one, else sim if it enables, else cpu.

Timing: on CUDA a pair of CUDA events brackets each repeat on the
stream, so the time is the GPU's and the host's launch overhead is hidden as it is in
training; elsewhere ``perf_counter`` after a device synchronize. Warm-up runs first (Triton
compiles, cuBLAS picks algorithms, the allocator grows), and medians are quoted with min/max.
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

DEVICES = ("auto", "cuda", "sim", "cpu")


@dataclass
class Device:
    """Where a benchmark runs.

    Attributes:
        torch: the ``torch.device`` tensors go to.
        kind: ``"cuda"``, ``"sim"`` or ``"cpu"`` (what actually runs, after any fallback).
        requested: what ``--device`` asked for.
        note: why the device differs from the request (a fallback), else None.
    """

    torch: torch.device
    kind: str
    requested: str
    note: str | None = None

    def describe(self) -> dict[str, Any]:
        """The JSON record of the device (its name and memory on CUDA)."""
        out: dict[str, Any] = {"requested": self.requested, "used": self.kind, "torch_device": str(self.torch),
                               "fallback": self.note}
        if self.kind == "cuda":
            props = torch.cuda.get_device_properties(self.torch)
            out.update(name=props.name, total_memory_bytes=props.total_memory,
                       capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count)
        return out


def _enable_sim() -> torch.device:
    """Register the simulated accelerator and return its device (ImportError until it exists)."""
    from outcore.offload import simdevice  # optional, being written beside this

    got = simdevice.enable()
    if isinstance(got, torch.device):
        return got
    if isinstance(got, str):
        return torch.device(got)
    return torch.device(torch._C._get_privateuse1_backend_name())


def resolve(name: str) -> Device:
    """The :class:`Device` for ``--device name``.

    Raises:
        SystemExit: ``cuda`` asked for where there is none, or an unknown name.
    """
    if name not in DEVICES:
        raise SystemExit(f"--device {name!r}: choose one of {', '.join(DEVICES)}")
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return Device(torch.device("cuda", torch.cuda.current_device()), "cuda", name)
    if name == "cuda":
        raise SystemExit("--device cuda: torch.cuda.is_available() is False here "
                         f"(torch {torch.__version__}); use --device sim or cpu")
    if name in ("auto", "sim"):
        try:
            return Device(_enable_sim(), "sim", name)
        except ImportError as exc:
            why = f"the simulated accelerator is not available ({exc}); ran on cpu"
        except Exception as exc:  # noqa: BLE001 - a broken sim must not stop a dry run, only be named
            why = f"outcore.offload.simdevice.enable() failed ({type(exc).__name__}: {exc}); ran on cpu"
        return Device(torch.device("cpu"), "cpu", name, why)
    return Device(torch.device("cpu"), "cpu", name)


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="cuda, the simulated accelerator (sim; falls back to cpu until it exists), cpu, "
                             "or auto (cuda > sim > cpu)")


def synchronize(dev: Device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, which runs synchronously)."""
    if dev.kind == "cuda":
        torch.cuda.synchronize(dev.torch)
    elif dev.kind == "sim":
        module = getattr(torch, dev.torch.type, None)  # a backend module, if the sim registered one
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()
        elif hasattr(torch, "accelerator") and torch.accelerator.is_available():
            torch.accelerator.synchronize()


def timer_name(dev: Device) -> str:
    return "cuda events" if dev.kind == "cuda" else "perf_counter after a device synchronize"


def time_repeats(fn: Callable[[], Any], dev: Device, repeats: int, warmup: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    On CUDA each call is bracketed by events recorded on the current stream and read after
    one synchronize at the end (no host round trip between repeats); elsewhere each call is
    timed with ``perf_counter`` between two synchronizes.
    """
    import time

    for _ in range(warmup):
        fn()
    synchronize(dev)
    if dev.kind == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(repeats)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(dev.torch)
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    return times


def summarize(times: list[float]) -> dict[str, Any]:
    """Median, min, max and count of a list of seconds (median: the figure to quote)."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


def cap_gpu_memory(dev: Device, gib: float | None) -> dict[str, Any] | None:
    """Cap this process's CUDA caching allocator at ``gib`` GiB (a consumer card's memory).

    ``set_per_process_memory_fraction`` must come before the first allocation; allocations
    beyond it raise OutOfMemoryError as on a card of that size. Returns the cap's record.
    """
    if dev.kind != "cuda" or not gib:
        return None
    total = torch.cuda.get_device_properties(dev.torch).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev.torch)
    return {"cap_bytes": int(gib * 2**30), "fraction": fraction, "device_total_bytes": total}


def peak_memory(dev: Device) -> dict[str, Any]:
    """The device allocator's peaks since the last reset (None off CUDA, where there is none)."""
    if dev.kind != "cuda":
        return {"max_allocated_bytes": None, "max_reserved_bytes": None}
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(dev.torch),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(dev.torch)}


def reset_peak_memory(dev: Device) -> None:
    if dev.kind == "cuda":
        torch.cuda.reset_peak_memory_stats(dev.torch)


def filesystem(path: str) -> dict[str, Any]:
    """The mount a path is on (device, type): "NVMe" figures need a disk, not tmpfs or overlay on RAM."""
    best = ("", "?", "?")
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, dev, fstype)
    except OSError:
        pass
    return {"path": path, "mount": best[0] or None, "device": best[1], "fstype": best[2]}


def machine() -> dict[str, Any]:
    """The host a figure was measured on (BENCHMARKING.md: state the machine)."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model,
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
