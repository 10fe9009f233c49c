"""Budgets and speeds the memory plan is made for: parsed from flags or taken from the probe.

:class:`Budgets` holds what each tier may use and how fast the links between tiers are;
:func:`budgets_from_probe` fills it from ``outcore.offload.store.probe.HardwareProbe`` with
explicit budgets (byte sizes read by :func:`outcore.bytesize.parse_bytes`) taking precedence.
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..bytesize import parse_bytes

#: Resident size of the Python process itself, outside every tier budget: peak RSS ~ tiers +
#: this. Libraries' code ~200 MiB (torch 75, triton 66), the heap ~250 (Python objects, the
#: tokenizer, the data); measured peaks of the default model minus their planned tiers came to
#: 290-400 MiB (long context, 4K-32K tokens, in `outcore finetune` and bench_long_context.py),
#: ~310-540 MiB (the default command, 4-40 steps), 0.87 GiB (the 70B QLoRA step).
RUNTIME_OVERHEAD_BYTES = 512 << 20
#: Share of free RAM / device memory the default budgets take (the rest is for the OS and others).
DEFAULT_SHARE = 0.85
#: Speeds assumed when the probe did not measure (``probe_hardware(measure=False)``).
FALLBACK_DISK_READ_GBPS = 1.5
FALLBACK_DISK_WRITE_GBPS = 1.5
FALLBACK_COPY_GBPS = {"cpu": 5.0, "cuda": 12.0}
# a consumer GPU's memory bandwidth, well under what it reaches (the update is element-wise,
# several kernels per tensor): a small share of the step either way
FALLBACK_DEVICE_MEM_GBPS = 300.0
FALLBACK_CHECKSUM_GBPS = 5.0  # xxh3 of the swap extents, one thread


@dataclass(frozen=True)
class Budgets:
    """What each tier may hold and how fast the links between tiers run.

    On a CPU-only machine (``device_kind="cpu"``) DEVICE is a RAM arena: DEVICE
    and HOST share the same physical RAM, so their sum must also fit ``ram_bytes``.
    """

    device_bytes: int  # DEVICE tier budget
    host_bytes: int  # HOST tier budget
    nvme_bytes: int  # free space the swap directory may use
    ram_bytes: int  # physical RAM the process may use for tiers (CPU-only: DEVICE + HOST <= this)
    device_kind: str = "cpu"  # "cpu" (DEVICE is a RAM arena) or "cuda"
    disk_read_gbps: float = FALLBACK_DISK_READ_GBPS  # NVMe -> HOST, GB/s (1e9)
    disk_write_gbps: float = FALLBACK_DISK_WRITE_GBPS  # HOST -> NVMe
    h2d_gbps: float = FALLBACK_COPY_GBPS["cpu"]  # HOST -> DEVICE
    d2h_gbps: float = FALLBACK_COPY_GBPS["cpu"]  # DEVICE -> HOST
    host_mem_gbps: float = FALLBACK_COPY_GBPS["cpu"]  # RAM bandwidth of a CPU optimizer update
    device_mem_gbps: float = FALLBACK_DEVICE_MEM_GBPS  # GPU memory bandwidth of its optimizer update
    checksum_gbps: float = FALLBACK_CHECKSUM_GBPS  # hashing every NVMe byte on the CPU
    flops: float = 0.0  # sustained matmul FLOP/s of the compute device (0: measure on first use)
    measured: bool = False  # True when the speeds come from measurement, not fallbacks
    swap_dir: str | None = None

    @property
    def shared_ram(self) -> bool:
        return self.device_kind == "cpu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def unlimited(cls, **speeds: Any) -> "Budgets":
        """Budgets no model exceeds (for sizing what a layout needs)."""
        big = 1 << 62
        return cls(device_bytes=big, host_bytes=big, nvme_bytes=big, ram_bytes=big, **speeds)

    def with_flops(self, dtype: str | None = None) -> "Budgets":
        """These budgets with ``flops`` measured (once per process) when it is 0, in the compute
        ``dtype`` (a CPU without bf16 units runs bf16 matmuls at another rate than fp32)."""
        if self.flops > 0:
            return self
        return replace(self, flops=measure_matmul_flops(self.device_kind, dtype=dtype))


def _first(probe: Any, *names: str) -> Any:
    for n in names:
        v = getattr(probe, n, None)
        if v is not None:
            return v
    return None


def budgets_from_probe(probe: Any, device_mem: str | int | None = None, host_mem: str | int | None = None,
                       nvme_mem: str | int | None = None, flops: float | None = None) -> Budgets:
    """Budgets from a ``HardwareProbe`` and the user's explicit limits.

    Defaults: a CUDA DEVICE gets 85% of the first GPU's free memory; HOST gets
    85% of available RAM minus the runtime overhead; on a CPU-only machine DEVICE
    and HOST each default to that whole RAM share (their sum is checked against it).

    Args:
        probe: ``outcore.offload.store.probe.HardwareProbe`` (its measured speeds are used
            when present, fallbacks otherwise).
        device_mem, host_mem, nvme_mem: explicit budgets (``"2GiB"`` or bytes); None = default.
        flops: the compute estimate in FLOP/s (None: measured on first use).

    Returns:
        The :class:`Budgets`.

    Raises:
        ConfigError: a budget string that is not a byte size.
    """
    devices = list(getattr(probe, "devices", None) or [])
    kind = "cuda" if devices else "cpu"
    avail = int(_first(probe, "ram_available_bytes", "ram_total_bytes") or 0)
    ram = max(0, int(avail * DEFAULT_SHARE) - RUNTIME_OVERHEAD_BYTES)
    if devices:
        dev_default = int(int(devices[0].get("free_bytes") or devices[0].get("total_bytes") or 0) * DEFAULT_SHARE)
    else:
        dev_default = ram
    read = _first(probe, "disk_read_gbps")
    write = _first(probe, "disk_write_gbps")
    h2d = _first(probe, "h2d_gbps")
    d2h = _first(probe, "d2h_gbps")
    host_bw = FALLBACK_COPY_GBPS["cpu"] if kind == "cuda" else (h2d or FALLBACK_COPY_GBPS["cpu"])
    host = parse_bytes(host_mem, "host_mem") if host_mem is not None else ram
    return Budgets(
        device_bytes=parse_bytes(device_mem, "device_mem") if device_mem is not None else dev_default,
        host_bytes=host,
        nvme_bytes=(parse_bytes(nvme_mem, "nvme_mem") if nvme_mem is not None
                    else int(_first(probe, "swap_free_bytes") or 0)),
        ram_bytes=max(ram, host) if kind == "cuda" else ram,
        device_kind=kind,
        disk_read_gbps=float(read or FALLBACK_DISK_READ_GBPS),
        disk_write_gbps=float(write or FALLBACK_DISK_WRITE_GBPS),
        h2d_gbps=float(h2d or FALLBACK_COPY_GBPS[kind]),
        d2h_gbps=float(d2h or FALLBACK_COPY_GBPS[kind]),
        host_mem_gbps=float(host_bw),
        checksum_gbps=float(_first(probe, "checksum_gbps") or FALLBACK_CHECKSUM_GBPS),
        flops=float(flops or 0.0),
        measured=all(x is not None for x in (read, write, h2d, d2h)),
        swap_dir=_first(probe, "swap_dir"),
    )


@functools.lru_cache(maxsize=None)
def measure_matmul_flops(device_kind: str = "cpu", n: int = 1024, seconds: float = 0.3,
                         dtype: str | None = None) -> float:
    """Sustained FLOP/s of a square matmul on the compute device (measured once per process).

    In ``dtype`` (default: fp32 on CPU, bf16 on CUDA). A transformer step reaches a good share of this
    (its matmuls dominate), so compute estimates built on it are optimistic
    by the share of time spent in non-matmul ops.

    Args:
        device_kind: ``"cpu"`` or ``"cuda"``.
        n: matrix size.
        seconds: time budget after one warm-up product.
        dtype: a name of ``outcore.dtypes.DTYPES``, or None for the device's usual one.

    Returns:
        The best observed FLOP/s.
    """
    import torch

    from ..offload.device import synchronize_device

    from ..dtypes import torch_dtype

    dev = torch.device(device_kind)
    dtype = torch_dtype(dtype) if dtype else (torch.bfloat16 if device_kind == "cuda" else torch.float32)

    def sync() -> None:
        synchronize_device(dev)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    torch.mm(a, b)
    sync()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end or best == 0.0:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = max(best, 2.0 * n ** 3 / max(time.perf_counter() - t0, 1e-9))
    return best
