"""Out-of-core training, assembled: store + unit memory + engine, sized from the plan.

:func:`offload_model` is what a recipe calls when ``offload`` is not ``none``;
it returns an :class:`OffloadedModel` whose ``train_step`` replaces
``loss.backward(); optimizer.step()``. Everything else (the schedule, the
hooks, the tiers) stays behind it.

Arena budgets are the *working set* the engine needs, not the machine's size:
arenas are preallocated and touched (their budget is physically real), so a
budget larger than the need would only waste RAM.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, ConfigError
from ..events import TierStats
from .engine import OutOfCoreEngine
from .handle import Tier
from .store import TieredStore
from .unit_memory import StoreUnitMemory
from .unit_sizes import working_set
from .units import WEIGHTS, Unit, causal_lm_units

class OffloadedModel:
    """A model in training whose weights and optimizer state live in a TieredStore.

    Build with :func:`offload_model`.
    """

    def __init__(self, engine: OutOfCoreEngine, store: TieredStore, swap_dir: Path | None):
        self.engine, self.store, self.swap_dir = engine, store, swap_dir
        self.mem: StoreUnitMemory = engine.mem  # type: ignore[assignment]
        # optimizer state passes through the HOST window rather than living there
        self._state_streams = any(h.home is Tier.NVME for u in engine.units
                                  for part, h in u.handles.items() if part.kind != WEIGHTS)

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        return self.engine.last_grad_norm

    def train_step(self, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], micro_batches: list[Any],
                   lr: float) -> torch.Tensor:
        """One optimizer step (forward, backward and every unit's update). See ``OutOfCoreEngine``."""
        if self._state_streams:
            # The HOST window holds optimizer state only while units update (the backward);
            # through the forward and the loss — the step's RSS peak — its pages are idle:
            # return them (~1% of a step to fault them back on a CPU-only machine).
            self.store.discard_free(Tier.HOST)
        return self.engine.train_step(loss_fn, micro_batches, lr)

    def tier_stats(self) -> dict[str, TierStats]:
        """Per-tier occupancy and traffic, bandwidth over the time since the previous call."""
        return self.store.tier_stats(window=True)

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for a transfer, since the start."""
        return self.mem.stall_s

    # -- checkpoints: one safetensors file per unit, streamed (bounded memory) ----------
    def save(self, directory: str | Path) -> None:
        """Write every unit's newest weights and optimizer state into ``directory``.

        One file per unit, read from the store one handle at a time, so the
        memory needed is one unit's, whatever the size of the model.
        """
        self.mem.flush()
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for unit in self.engine.units:
            # a pieced state is saved joined: the checkpoint does not depend on the split
            tensors = {WEIGHTS: self.mem.state(unit.index, WEIGHTS),
                       **{kind: self.mem.state(unit.index, kind) for kind in self.mem.kinds(unit.index)}}
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(d / f"{unit.name}.safetensors"))
        (d / "units.json").write_text(json.dumps([u.name for u in self.engine.units]))

    def load(self, directory: str | Path) -> None:
        """Replace every unit's weights and state with those saved by :meth:`save`.

        Raises:
            CheckpointError: files missing, or not of this model / optimizer.
        """
        d = Path(directory)
        names = [u.name for u in self.engine.units]
        try:
            saved = json.loads((d / "units.json").read_text())
        except (OSError, ValueError):
            raise CheckpointError(f"{str(d)!r} holds no out-of-core checkpoint (units.json missing or damaged)") from None
        if saved != names:
            raise CheckpointError(f"{str(d)!r} was saved from another model ({len(saved)} units, "
                                  f"this one has {len(names)}); resume with the same --model")
        for unit in self.engine.units:
            tensors = load_file(str(d / f"{unit.name}.safetensors"))
            for kind in [WEIGHTS, *self.mem.kinds(unit.index)]:
                shape, dtype = self.mem.kind_layout(unit.index, kind)
                t = tensors.get(kind)
                if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                    raise CheckpointError(f"{unit.name}.{kind} in {str(d)!r} does not match this run's "
                                          "optimizer state; resume with the same --optim and --model")
                self.mem.overwrite(unit.index, kind, t)

    def named_weights(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's parameters by model name, copied out of the store (blocks)."""
        flat = self.mem.weights(unit.index)
        return {s.name: unit.view(flat, s).clone() for s in unit.slots}

    def merged_weights(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's weights as a plain model has them: LoRA deltas merged in, peft's
        name prefixes dropped (``base_model.model.``, ``.base_layer``)."""
        from ..models import lora_deltas, plain_name

        tensors = self.named_weights(unit)
        deltas: dict[int, torch.Tensor] = {}
        for module in unit.modules:
            deltas.update(lora_deltas(module))
        for s in unit.slots:
            if id(s.param) in deltas:
                tensors[s.name] += deltas[id(s.param)].to(tensors[s.name].dtype)
        return {plain_name(n): t for n, t in tensors.items()}

    def export_hf(self, out_dir: str | Path, hf_config: Any, tokenizer: Any = None) -> Path:
        """Write a Hugging Face directory, one safetensors shard per unit (bounded memory).

        ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it; tied weights are
        stored once, as transformers expects; LoRA adapters are merged into the base.
        """
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weight_map, total = {}, 0
        for unit in self.engine.units:
            tensors = self.merged_weights(unit)
            if not tensors:
                continue
            shard = f"model-{unit.index:05d}-{unit.name}.safetensors"
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
            for name, t in tensors.items():
                weight_map[name] = shard
                total += t.numel() * t.element_size()
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        hf_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return out

    def close(self) -> None:
        """Finish every write, take the hooks off, free the arenas and remove the swap directory."""
        try:
            self.mem.flush()
        finally:
            self.engine.remove()
            self.store.close()


def offload_model(model: torch.nn.Module, optimizer: Any, *, offload: str, swap_dir: str | Path | None,
                  prefetch: int = 2, max_grad_norm: float = 0.0, grad_accum: int = 1,
                  device_bytes: int | None = None, host_bytes: int | None = None,
                  homes: list[tuple[Tier, Tier]] | None = None,
                  head_modules: list[torch.nn.Module] | tuple[torch.nn.Module, ...] = (),
                  init_weights: Callable[[Any, torch.Tensor], None] | None = None,
                  resident_trainable: bool = False, master_weights: bool = True,
                  quantize_frozen: bool = False, spill_grads: bool | None = None,
                  split_state: bool = True) -> OffloadedModel:
    """Move ``model``'s weights and ``optimizer``'s state into tiers and wrap it for training.

    Args:
        model: a causal LM (see ``units.causal_lm_units``), weights initialized.
        optimizer: an ``outcore.optim.OutcoreOptimizer`` over the trainable parameters.
        offload: ``cpu`` (authoritative copies in HOST) or ``nvme`` (in the swap dir).
        swap_dir: the swap directory (created 0700, locked; required for ``nvme``).
        prefetch: units fetched ahead (k).
        max_grad_norm, grad_accum: as in the config (either one disables step-in-backward).
        device_bytes, host_bytes: caps on the DEVICE / HOST arenas (default: the working set).
        homes: per unit (weights tier, state tier), e.g. from a ``MemoryPlan``; overrides ``offload``.
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
        spill_grads: with clipping or accumulation, write each unit's gradients to the
            optimizer state's tier as soon as they are complete (default: when that tier
            is NVMe), so gradients never all sit in RAM.
        split_state: stream the state of a unit far larger than a block (the embedding)
            in block-sized pieces when the optimizer updates element-wise (see
            ``unit_sizes.state_pieces``), so the HOST window is a few blocks, not the
            embedding's whole state. Bit-identical either way.

    Returns:
        The :class:`OffloadedModel`.

    Raises:
        ConfigError: an unknown ``offload`` or ``nvme`` without a swap dir.
        BudgetError: a cap smaller than one unit needs.
        SwapDirError: the swap dir cannot be used.
    """
    if offload not in ("cpu", "nvme"):
        raise ConfigError(f"offload={offload!r}: the out-of-core engine takes 'cpu' or 'nvme'")
    units = causal_lm_units(model, resident_trainable=resident_trainable, head_modules=head_modules)
    home = Tier.NVME if offload == "nvme" else Tier.HOST
    homes = homes or [(home, home)] * len(units)
    uses_nvme = any(Tier.NVME in h for h in homes)
    if uses_nvme and swap_dir is None:
        raise ConfigError("offload=nvme needs a swap directory; pass --swap-dir DIR on a fast disk")

    k = max(1, prefetch)
    if spill_grads is None:
        spill_grads = any(s is Tier.NVME for _, s in homes)
    spill_grads = spill_grads and (max_grad_norm > 0 or grad_accum > 1) and not resident_trainable
    need = working_set(units, optimizer, homes, k, master_weights=master_weights, spill_grads=spill_grads,
                       quantize_frozen=quantize_frozen, split_state=split_state)
    device = min(device_bytes, need.device) if device_bytes else need.device
    host = min(host_bytes, need.host) if host_bytes else need.host
    store = TieredStore(device_bytes=device, host_bytes=max(host, 4096), swap_dir=swap_dir if uses_nvme else None)
    try:
        engine = OutOfCoreEngine(model, optimizer,
                                 lambda us, opt: StoreUnitMemory(store, us, opt, homes=homes,
                                                                 init_weights=init_weights,
                                                                 master_weights=master_weights,
                                                                 quantize_frozen=quantize_frozen,
                                                                 state_piece_bytes=need.piece_bytes),
                                 prefetch=k, max_grad_norm=max_grad_norm, grad_accum=grad_accum, units=units,
                                 spill_grads=spill_grads)
    except BaseException:
        store.close()
        raise
    return OffloadedModel(engine, store, Path(swap_dir) if uses_nvme else None)

