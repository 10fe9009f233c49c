"""outcore.offload — three memory tiers (DEVICE, HOST, NVME) as one store.

See docs/architecture.md §3–§5 and §7.

Every swappable tensor (a block's weights, gradients, optimizer state, a saved
activation) is one :class:`TensorHandle` in a :class:`TieredStore`. Its
authoritative copy lives in its *home* tier (NVME or HOST); working copies are
fetched into faster tiers, computed on in place through a tensor *view*, marked
dirty and written back asynchronously. Budgets are exact and never exceeded;
NVMe I/O is O_DIRECT through a small thread pool, with a checksum per extent.
Units of a model (``engine/units.py``) keep their buffers in a :class:`StoreUnitMemory`
(``engine/unit_memory.py``) over the store; first-order training (``engine/``) and
zeroth-order block streaming (``zo/``) both stream through it::

    store = TieredStore(device_bytes=2 << 30, host_bytes=8 << 30, nvme_bytes=64 << 30,
                        swap_dir="outputs/run/swap")
    h = store.register("block0.w", data=w)             # home NVME: written to the swap file
    w = store.fetch(h, Tier.DEVICE).result()           # view in the DEVICE arena, pinned
    ...compute with w (update it in place for an optimizer step)...
    store.mark_dirty(h, Tier.DEVICE); store.write_back(h)   # async write-back to NVMe
    store.release(h, Tier.DEVICE); store.evict(h, Tier.DEVICE)
    stats = store.tier_stats(window=True)              # -> events.StepEvent.tiers
    store.close()                                      # removes the swap dir

``probe_hardware()`` measures what the machine offers.

Layers, low to high, each importing only those below it: the device layer (``device.py``,
``modes.py``, the simulated accelerator), ``store/``, ``distributed/``, ``engine/``, ``zo/``.
"""
from .._exports import lazy_exports

# Lazy exports (PEP 562): ``import outcore.offload`` stays free of torch until a name is used.
_EXPORTS = {
    "Device": ".device", "IOPool": ".store", "Residency": ".store", "TensorHandle": ".store",
    "Tier": ".store", "Extent": ".store", "NvmeBackend": ".store",
    "HardwareProbe": ".store", "probe_hardware": ".store", "TieredStore": ".store",
    "SwapDir": ".store", "find_leftover_swap_dirs": ".store",
    "parse_bytes": "..bytesize", "format_bytes": "..bytesize", "OutOfCoreEngine": ".engine",
    "offload_model": ".engine", "ZOBlockTrainer": ".zo",
}
__all__ = list(sorted(_EXPORTS))


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
