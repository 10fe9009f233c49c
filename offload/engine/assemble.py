"""Out-of-core training, assembled: store + unit memory + engine, sized from the plan.

:func:`offload_model` is what a recipe calls when ``offload`` is not ``none``; it
returns the :class:`OutOfCoreEngine`, whose ``train_step`` replaces
``loss.backward(); optimizer.step()``. Everything else (the schedule, the hooks, the
tiers) stays behind it.

Arena budgets are the *working set* the engine needs, not the machine's size:
arenas are preallocated and touched (their budget is physically real), so a
budget larger than the need would only waste RAM.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ...errors import ConfigError
from ..device import Device
from ..distributed import Ranks
from ..modes import NVME, STREAMED_MODES, UPDATE_ON
from ..store import Tier, TieredStore
from .engine import OutOfCoreEngine
from .sharding import shard_units
from .unit_memory import StoreUnitMemory
from .unit_sizes import working_set
from .units import Unit, causal_lm_units


def offload_model(model: torch.nn.Module, optimizer: Any, *, offload: str, swap_dir: str | Path | None,
                  prefetch: int = 2, max_grad_norm: float = 0.0, grad_accum: int = 1,
                  device_bytes: int | None = None, host_bytes: int | None = None,
                  homes: list[tuple[Tier, Tier, Tier]] | None = None, head_modules: Sequence[torch.nn.Module] = (),
                  init_weights: Callable[[Any, torch.Tensor], None] | None = None,
                  resident_trainable: bool = False, master_weights: bool = True,
                  quantize_frozen: bool = False, spill_grads: bool | None = None,
                  split_state: bool = True, nvme_reserve: int = 0, nvme_keep: int = 0,
                  ranks: Ranks | None = None, device: str | torch.device | None = "auto",
                  update_on: str = "device") -> OutOfCoreEngine:
    """Move ``model``'s weights and ``optimizer``'s state into tiers and wrap it for training.

    Args:
        model: a causal LM (see ``units.causal_lm_units``), weights initialized.
        optimizer: an ``outcore.optim.OutcoreOptimizer`` over the trainable parameters.
        offload: ``cpu`` (authoritative copies in HOST) or ``nvme`` (in the swap dir).
        swap_dir: the swap directory (created 0700, locked; required for ``nvme``).
        prefetch: units fetched ahead (k).
        max_grad_norm, grad_accum: as in the config (either one disables step-in-backward).
        device_bytes, host_bytes: caps on the DEVICE / HOST arenas (default: the working set).
        homes: per unit, the home tiers of (weights, state, spilled gradients), e.g. from a
            ``MemoryPlan``; overrides ``offload``. Gradients go to the state's tier or to HOST.
        head_modules: modules that use the head's weights without calling ``lm_head``
            (e.g. ``CausalLMHeadLoss``); see ``units.causal_lm_units``.
        init_weights: for a model built on the meta device, fills each parameter
            ``(slot, tensor)`` as its unit is stored (see ``StoreUnitMemory``).
        resident_trainable: LoRA / QLoRA: only the frozen base streams (read-only,
            never written back); the trainable adapters stay resident and
            ``optimizer`` (any torch optimizer over them) steps them after the backward.
        master_weights: mixed precision: a model in bf16 / fp16 computes in it while the
            optimizer updates fp32 master weights kept in the state tier (default);
            False trains the 16-bit weights themselves.
        quantize_frozen: QLoRA: the blocks' frozen matrices are stored (and streamed) in
            NF4 and dequantized into the model's dtype when fetched (see ``nf4.py``).
        spill_grads: with clipping or accumulation, write each unit's gradients to their
            home tier (``homes``) as soon as they are complete (default: when the state's tier
            is NVMe), so gradients never all sit on DEVICE. They live one step: a HOST home
            keeps them off the SSD (no write, no wear) where RAM holds them.
        split_state: stream the state of a unit far larger than a block (the embedding)
            in block-sized pieces when the optimizer updates element-wise (see
            ``unit_sizes.state_pieces``), so the HOST window is a few blocks, not the
            embedding's whole state. Bit-identical either way.
        nvme_reserve: bytes the plan puts on NVMe, preallocated now (0: grow on demand), so a
            disk too small fails before the units are written.
        nvme_keep: once the units are stored, the swap file keeps this much room past their
            extents (what comes and goes during the steps: spilled gradients, offloaded
            activations) and gives the rest of the reservation back (see ``NvmeBackend.trim``).
        ranks: data parallelism (``world > 1``): each rank keeps 1/world of the state (``sharding.py``).
        device: where the model computes (``auto``: the GPU when there is one; see
            ``device.resolve_device``): the DEVICE tier's memory, and, on an accelerator, where
            the update runs unless ``update_on`` says otherwise.
        update_on: where an accelerator's out-of-core update runs: ``device`` (the state streams
            to it) or ``host`` (the state stays in HOST RAM and the CPU updates it; gradients
            come down and updated weights go up: ZeRO-Offload's placement). The same on a
            CPU-only machine.

    Returns:
        The :class:`OutOfCoreEngine`, owning the store (``close()`` it when done).

    Raises:
        ConfigError: an unknown ``offload`` or ``update_on``, ``nvme`` without a swap dir, or sharding
            what cannot be.
        BudgetError: a cap smaller than one unit needs.
        SwapDirError: the swap dir cannot be used (``DiskFullError``: too small for ``nvme_reserve``).
    """
    if offload not in STREAMED_MODES:
        raise ConfigError(f"offload={offload!r}: the out-of-core engine takes 'cpu' or 'nvme'")
    if update_on not in UPDATE_ON:
        raise ConfigError(f"update_on={update_on!r}: choose one of {', '.join(UPDATE_ON)}")
    units = causal_lm_units(model, resident_trainable=resident_trainable, head_modules=head_modules)
    world = shard_units(units, optimizer, ranks, resident_trainable)
    homes = homes or [(Tier.NVME if offload == NVME else Tier.HOST,) * 3] * len(units)
    k = max(1, prefetch)
    master_weights = master_weights and getattr(optimizer, "wants_master", True)  # see OutcoreOptimizer
    if spill_grads is None:  # (sharded: the ranks' gradients are summed as each unit's completes)
        spill_grads = world > 1 or any(s is Tier.NVME for _, s, _ in homes)
    spill_grads = spill_grads and (max_grad_norm > 0 or grad_accum > 1) and not resident_trainable
    store, memory = _store_and_memory(units, optimizer, homes, k, device, caps=(device_bytes, host_bytes),
                                      swap_dir=swap_dir, nvme_reserve=nvme_reserve, init_weights=init_weights,
                                      master_weights=master_weights, spill_grads=spill_grads,
                                      quantize_frozen=quantize_frozen, split_state=split_state,
                                      update_on_device=update_on == "device")
    try:
        engine = OutOfCoreEngine(model, optimizer, memory, prefetch=k, max_grad_norm=max_grad_norm,
                                 grad_accum=grad_accum, units=units, spill_grads=spill_grads, world=world)
        if store.nvme is not None:
            store.nvme.trim(keep=nvme_keep)
    except BaseException:
        store.close()
        raise
    return engine


def _store_and_memory(units: list[Unit], optimizer: Any, homes: list[tuple[Tier, Tier, Tier]], k: int,
                      device: str | torch.device | None, *,
                      caps: tuple[int | None, int | None], swap_dir: str | Path | None, nvme_reserve: int,
                      init_weights: Callable[[Any, torch.Tensor], None] | None, master_weights: bool,
                      spill_grads: bool, quantize_frozen: bool, split_state: bool, update_on_device: bool
                      ) -> tuple[TieredStore, Callable[[list[Unit], Any], StoreUnitMemory]]:
    """The store of ``units``, its DEVICE and HOST arenas sized to their working set, and the
    engine's unit memory on it.

    Args:
        units, optimizer, homes: as :func:`offload_model` resolved them.
        k: the prefetch depth.
        device: where the model computes (the store's ``Device``, closed with it).
        caps: ``(device_bytes, host_bytes)``: caps on the arenas (None: the working set).
        swap_dir, nvme_reserve, init_weights, master_weights, spill_grads, quantize_frozen,
            split_state: as in :func:`offload_model`.
        update_on_device: ``offload_model``'s ``update_on == "device"``.

    Returns:
        ``(store, memory)``: ``memory(units, optimizer)`` makes the ``StoreUnitMemory`` the
        engine takes.

    Raises:
        ConfigError: a unit homed on NVMe and no ``swap_dir``.
    """
    uses_nvme = any(Tier.NVME in h for h in homes)
    if uses_nvme and swap_dir is None:
        raise ConfigError("offload=nvme needs a swap directory; pass --swap-dir DIR on a fast disk")
    compute = Device(device)  # the store's, closed with it
    need = working_set(units, optimizer, homes, k, master_weights=master_weights, spill_grads=spill_grads,
                       quantize_frozen=quantize_frozen, split_state=split_state, accelerator=compute.is_accelerator,
                       update_on_device=update_on_device)
    device_bytes, host_bytes = caps
    device_cap = min(device_bytes, need.device) if device_bytes else need.device
    host = min(host_bytes, need.host) if host_bytes else need.host
    store = TieredStore(device_bytes=device_cap, host_bytes=max(host, 4096),
                        swap_dir=swap_dir if uses_nvme else None, nvme_reserve=nvme_reserve, device=compute)

    def memory(us: list[Unit], opt: Any) -> StoreUnitMemory:
        return StoreUnitMemory(store, us, opt, homes=homes, init_weights=init_weights, master_weights=master_weights,
                               quantize_frozen=quantize_frozen, state_piece_bytes=need.piece_bytes,
                               update_on_device=update_on_device)

    return store, memory
