"""outcore.offload.store — three memory tiers (DEVICE, HOST, NVME) as one store of tensor handles.

A :class:`TieredStore` keeps every swappable tensor as a :class:`TensorHandle` with exact
per-tier budgets: arenas in RAM and device memory, a checksummed ``O_DIRECT`` swap file on
NVMe (in a locked :class:`SwapDir`), asynchronous copies between them. ``probe_hardware``
measures what the machine offers. It knows nothing of models: the engine builds on it.
"""
from ..._exports import lazy_exports

_EXPORTS = {
    "Tier": ".handle", "Residency": ".handle", "TensorHandle": ".handle",
    "TieredStore": ".store", "TierTraffic": ".traffic",
    "IOPool": ".directio", "discard_pages": ".directio",
    "Extent": ".nvme", "NvmeBackend": ".nvme",
    "SwapDir": ".swapdir", "find_leftover_swap_dirs": ".swapdir", "LOCK_NAME": ".swapdir",
    "LockHeld": ".swapdir", "hold_lock": ".swapdir", "is_locked": ".swapdir",
    "HardwareProbe": ".probe", "probe_hardware": ".probe",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
