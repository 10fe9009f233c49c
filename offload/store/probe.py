"""Hardware probe: what this machine offers the three tiers (docs/architecture.md §6).

``outcore doctor`` prints :func:`probe_hardware`'s answer and the planner sizes
its tiers from it. Disk figures are *measured* with outcore's own I/O engine
(``O_DIRECT``, 1 MiB chunks, the engine's queue depth) in a temporary
subdirectory of the swap directory, so they are what the NVMe tier will get.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ..aligned import aligned_empty
from ..device import Device
from .directio import IOPool, open_direct, supports_o_direct
from .swapdir import find_leftover_swap_dirs

LOW_FREE_BYTES = 20 << 30  # warn below this much free space in the swap dir
_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}
_BACKENDS = {  # import name -> distribution names to ask for a version
    "kvikio": ("kvikio", "kvikio-cu12", "kvikio-cu11", "kvikio-cu13"),
    "triton": ("triton",),
    "bitsandbytes": ("bitsandbytes",),
    "deepspeed": ("deepspeed",),
}


@dataclass
class HardwareProbe:
    """What the machine has, measured where it says so."""

    cpu_threads: int  # CPU threads this process may use
    ram_total_bytes: int
    ram_available_bytes: int
    devices: list[dict]  # CUDA devices: name, total_bytes, free_bytes ([] on CPU)
    swap_dir: str  # the directory probed (absolute)
    swap_free_bytes: int  # free bytes on its file system
    swap_fs_type: str  # e.g. ext4, xfs, tmpfs ("unknown" if not found in /proc/mounts)
    o_direct: bool  # files there accept O_DIRECT I/O
    disk_read_gbps: float | None  # measured sequential read, GB/s (1e9); None when measure=False
    disk_write_gbps: float | None  # measured sequential write, GB/s
    h2d_gbps: float | None  # host->device copy, GB/s (RAM-arena copy on CPU)
    d2h_gbps: float | None  # device->host copy, GB/s
    checksum_gbps: float | None = None  # xxh3 of swap extents on one thread, GB/s (every NVMe byte is hashed)
    backends: dict[str, str | None] = field(default_factory=dict)  # package -> version or None
    warnings: list[str] = field(default_factory=list)
    leftover_swap_dirs: list[str] = field(default_factory=list)  # swap dirs no live run holds

    def to_dict(self) -> dict:
        """A JSON-able dict of every field."""
        return asdict(self)


def _existing_ancestor(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def fs_type(path: str | Path) -> str:
    """The file system type of ``path`` from ``/proc/mounts`` (longest matching mount point)."""
    real = os.path.realpath(_existing_ancestor(Path(path).absolute()))
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def backend_versions() -> dict[str, str | None]:
    """Version of each optional backend (None when absent); nothing is imported."""
    out: dict[str, str | None] = {}
    for mod, dists in _BACKENDS.items():
        version = None
        try:
            present = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            present = False
        if present:
            version = "unknown"
            for d in dists:
                try:
                    version = importlib.metadata.version(d)
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
        out[mod] = version
    return out


def foreign_kernels_package() -> str | None:
    """The location of a top-level ``kernels`` package that is not outcore's, if any.

    Hugging Face's Kernel Hub installs one; a tool that imports ``kernels``
    expecting outcore's (or the reverse) would get the wrong code.
    """
    try:
        spec = importlib.util.find_spec("kernels")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]


def measure_disk_gbps(directory: str | Path, seconds: float = 2.0,
                      max_bytes: int = 1 << 30, pool: IOPool | None = None) -> tuple[float, float, bool]:
    """Sequential write then read bandwidth of ``directory`` with the engine.

    Writes 64 MiB requests (split into the pool's 1 MiB chunks) for about
    ``seconds / 2``, then reads the same bytes back for about ``seconds / 2``.
    With ``O_DIRECT`` the reads come from the disk; without it the page cache
    is dropped for the file first (``POSIX_FADV_DONTNEED``).

    Args:
        directory: where to put the temporary file (removed afterwards).
        seconds: total time budget.
        max_bytes: largest file to write (also capped at 1/4 of free space).
        pool: the I/O pool (default: a fresh ``IOPool()``).

    Returns:
        ``(read_gbps, write_gbps, o_direct)`` in GB/s (1e9 bytes).
    """
    req = 64 << 20
    free = shutil.disk_usage(directory).free
    limit = max(req, min(max_bytes, free // 4) // req * req)
    own_pool = pool is None
    pool = pool or IOPool()
    buf = aligned_empty(req)
    buf.copy_(torch_randbytes(req))
    fd_path = Path(tempfile.mkdtemp(prefix=".outcore-probe-", dir=directory)) / "bw"
    fd, direct = open_direct(fd_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        t0, written = time.perf_counter(), 0
        while written < limit and (written == 0 or time.perf_counter() - t0 < seconds / 2):
            pool.write(fd, buf, written).result()
            written += req
        if not direct:
            os.fsync(fd)
        t_w = time.perf_counter() - t0
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0, read = time.perf_counter(), 0
        while read < written and (read == 0 or time.perf_counter() - t0 < seconds / 2):
            pool.read(fd, buf, read).result()
            read += req
        t_r = time.perf_counter() - t0
    finally:
        os.close(fd)
        shutil.rmtree(fd_path.parent, ignore_errors=True)
        if own_pool:
            pool.close()
    return read / t_r / 1e9, written / t_w / 1e9, direct


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


def measure_checksum_gbps(nbytes: int = 64 << 20, seconds: float = 0.2) -> float:
    """Single-thread throughput (GB/s) of the NVMe tier's extent checksum (``nvme.checksum``).

    Every byte read from or written to the swap file is hashed on an I/O thread: on a
    machine with few cores that is CPU time the compute does not get (the plan counts it).
    """
    from .nvme import checksum

    buf = torch_randbytes(nbytes)
    checksum(buf)  # warm-up
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end or best == 0.0:
        t0 = time.perf_counter()
        checksum(buf)
        best = max(best, nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9)
    return best


def torch_randbytes(n: int):
    """``n`` random bytes as a uint8 tensor (incompressible data for disk tests)."""
    import torch
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def probe_hardware(swap_dir: str | Path | None = None, measure: bool = True,
                   seconds: float = 2.0) -> HardwareProbe:
    """Probe CPU, RAM, devices, the swap directory and optional backends.

    Args:
        swap_dir: the swap directory to probe (it need not exist yet: its nearest
            existing ancestor is measured). Default: ``$OUTCORE_SWAP_DIR`` or the
            current directory (where ``outputs/…/swap`` goes by default).
        measure: run the bandwidth measurements (a few seconds, writes up to
            1 GiB to the swap dir and removes it). False: those fields are None.
        seconds: time budget of the disk measurement.

    Returns:
        A :class:`HardwareProbe`.
    """
    from ..device import list_devices

    target = Path(swap_dir or os.environ.get("OUTCORE_SWAP_DIR") or os.getcwd()).expanduser().absolute()
    where = _existing_ancestor(target)
    vm = psutil.virtual_memory()
    try:
        threads = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        threads = os.cpu_count() or 1
    kind = fs_type(where)
    free = shutil.disk_usage(where).free
    writable = os.access(where, os.W_OK)
    o_direct = writable and supports_o_direct(where)

    warnings: list[str] = []
    foreign = foreign_kernels_package()
    if foreign:
        warnings.append(f"a foreign top-level package 'kernels' is installed ({foreign}); "
                        "outcore's kernels are outcore.kernels — import them by that name")
    if kind in _MEMORY_FS:
        warnings.append(f"swap dir {target} is on {kind} (RAM): the NVMe tier would use memory, not disk")
    if not writable:
        warnings.append(f"swap dir {where} is not writable")
    elif not o_direct:
        warnings.append(f"swap dir {target} does not support O_DIRECT ({kind}): "
                        "NVMe I/O will be buffered through the page cache")
    if free < LOW_FREE_BYTES:
        warnings.append(f"swap dir {target} has only {free / 2**30:.1f} GiB free")
    leftovers = find_leftover_swap_dirs(where)
    if leftovers:
        warnings.append(f"{len(leftovers)} leftover swap dir(s) from runs that did not exit cleanly: "
                        + ", ".join(leftovers))

    r = w = h2d = d2h = hashing = None
    if measure:
        if writable:
            r, w, _ = measure_disk_gbps(where, seconds=seconds)
        h2d, d2h = measure_copy_gbps(seconds=min(0.5, seconds / 4))
        hashing = measure_checksum_gbps(seconds=min(0.2, seconds / 8))

    return HardwareProbe(
        cpu_threads=threads, ram_total_bytes=int(vm.total), ram_available_bytes=int(vm.available),
        devices=list_devices(), swap_dir=str(target), swap_free_bytes=int(free),
        swap_fs_type=kind, o_direct=o_direct, disk_read_gbps=r, disk_write_gbps=w,
        h2d_gbps=h2d, d2h_gbps=d2h, checksum_gbps=hashing, backends=backend_versions(), warnings=warnings,
        leftover_swap_dirs=leftovers)
