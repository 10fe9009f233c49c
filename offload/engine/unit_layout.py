"""A unit laid out in the store: its weights and optimizer state as flat buffers, one handle each.

:func:`store_unit` registers a :class:`Unit`'s buffers with the :class:`TieredStore` and
gives the unit its :class:`UnitLayout` (homes, handles, state layout, pieces, NF4 layout) —
the only writer of it — one unit at a time, so a model built on the meta device is never
whole in RAM. Sizes and the piece split come from ``unit_sizes.py``, which
computes them before the store exists.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..store import Tier, TieredStore
from .nf4 import NF4Layout
from .unit_sizes import MASTER_DTYPE, _unit_dtype, needs_master, ram_kinds, state_pieces
from .units import WEIGHTS, ParamSlot, Part, StateSlot, Unit, UnitLayout, _pad

InitWeights = Callable[[ParamSlot, torch.Tensor], None]


def store_unit(store: TieredStore, unit: Unit, optimizer: Any, homes: tuple[Tier, Tier, Tier],
               init_weights: InitWeights | None = None, master_weights: bool = True,
               quantize_frozen: bool = False, state_piece_bytes: int | None = None,
               state_streams: bool = False) -> None:
    """Register ``unit``'s weights and optimizer state with ``store`` and set ``unit.layout``.

    Args:
        store: the tiered store.
        unit: the unit; its parameters still hold the initial weights (or are on the meta
            device, see ``init_weights``). Afterwards they point at empty tensors.
        optimizer: an ``OutcoreOptimizer`` (``state_spec`` / ``init_state``), or None when the
            unit trains without optimizer state (zeroth-order).
        homes: home tiers of (weights, optimizer state, spilled gradients).
        init_weights: fills a meta-device parameter's weights ``(slot, view [shape])``.
        master_weights: a 16-bit trainable parameter keeps an fp32 master as optimizer state
            (kind ``master``); ``init_weights`` then fills the master, in fp32.
        quantize_frozen: store the frozen block matrices in NF4 (QLoRA).
        state_piece_bytes: split a state larger than this into pieces (see ``state_pieces``);
            only a state that streams is split: one whose home is NVMe, or any on an
            accelerator (``state_streams``: the update runs there, the state comes to it).

    Raises:
        ValueError: a meta parameter without ``init_weights``, or a state kind mixing dtypes.
    """
    w_home, s_home, _ = homes
    split = None
    if (s_home is Tier.NVME or unit.shard or state_streams) and optimizer is not None:
        split = state_pieces(unit, optimizer, state_piece_bytes, master_weights)
        if split is None and unit.shard:
            raise ValueError(f"the optimizer state of {unit.name} cannot be cut into ranges (sharding.shard_units)")
    w, masters = _initial_weights(unit, init_weights, master_weights)
    nf4 = None
    if quantize_frozen and NF4Layout.any_quantized(unit):
        nf4 = NF4Layout(unit, w.dtype)
        w4 = torch.zeros(nf4.nbytes, dtype=torch.uint8)
        for k, slot in enumerate(unit.slots):
            nf4.encode(k, unit.view(w, slot), w4)
        w = w4
    h = store.register(f"{unit.name}:{WEIGHTS}", data=w, home=w_home)
    flat = {WEIGHTS: (h.numel, h.dtype)}
    del w
    states, inits = _state_layout(unit, optimizer, masters, flat)
    pieces, ratios = (tuple(split.pieces), split.ratios) if split is not None else ((), {})
    layout = UnitLayout(homes, {Part(WEIGHTS): h}, states, flat, pieces, ratios, nf4)
    kinds = list(flat.items())[1:]
    in_ram = ram_kinds({kind: numel * dtype.itemsize for kind, (numel, dtype) in kinds}) if s_home is Tier.NVME else ()
    for kind, (_numel, dtype) in kinds:
        home = Tier.HOST if kind in in_ram else s_home  # a small kind (scales) stays in RAM
        for part, lo, hi in layout.kind_parts(kind):
            layout.handles[part] = store.register(f"{unit.name}:{part}", home=home, shape=(hi - lo,), dtype=dtype,
                                                  data=_initial_state(states, kind, lo, hi, dtype, inits))
    # The initial state goes before the weights: freed the other way round, glibc's heap
    # stayed fragmented and RSS grew ~8 MB per block (tests/offload/engine/test_bounded_rss.py).
    del masters, inits
    unit.layout = layout
    for slot in unit.slots:  # the store holds the unit now: free the model's own copy
        slot.param.data = torch.empty(0, dtype=slot.param.dtype)


def _initial_weights(unit: Unit, init_weights: InitWeights | None, master_weights: bool
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The unit's flat weights [numel] and, per 16-bit trainable slot, its fp32 master.

    A meta-device parameter is materialized here (``init_weights``) and swapped onto a
    view of the flat buffer, so the optimizer's ``state_spec`` sees a real tensor.
    """
    w = torch.empty(unit.numel, dtype=_unit_dtype(unit))
    masters: dict[int, torch.Tensor] = {}  # slot index -> fp32 master (mixed precision)
    for k, slot in enumerate(unit.slots):
        wants_master = master_weights and needs_master(slot.param)
        if wants_master:
            masters[k] = torch.empty(slot.shape, dtype=MASTER_DTYPE)
        if not slot.param.is_meta:
            unit.view(w, slot).copy_(slot.param.data)
            if wants_master:
                masters[k].copy_(slot.param.data)
            continue
        if init_weights is None:
            raise ValueError(f"{slot.name} is on the meta device and no init_weights was given")
        if wants_master:
            init_weights(slot, masters[k])
            unit.view(w, slot).copy_(masters[k])  # round to nearest, as .to() does
        else:
            init_weights(slot, unit.view(w, slot))
        # `.data =` cannot move a parameter off the meta device: swap its contents (the
        # Parameter object, held by the optimizer and by tied modules, stays the same).
        torch.utils.swap_tensors(slot.param, torch.nn.Parameter(
            unit.view(w, slot), requires_grad=slot.param.requires_grad))
    return w, masters


def _state_layout(unit: Unit, optimizer: Any, masters: dict[int, torch.Tensor],
                  flat: dict[str, tuple[int, torch.dtype]]
                  ) -> tuple[tuple[dict[str, StateSlot], ...], list[dict[str, torch.Tensor]]]:
    """Per slot, where each state kind lies, and each slot's initial state, from the optimizer's
    ``state_spec``; each kind's flat size goes into ``flat``."""
    states: list[dict[str, StateSlot]] = []
    inits: list[dict[str, torch.Tensor]] = []
    group = optimizer.param_groups[0] if optimizer is not None else {}
    for k, slot in enumerate(unit.slots):
        entry: dict[str, StateSlot] = {}
        states.append(entry)
        if not slot.param.requires_grad or optimizer is None:  # frozen, or no optimizer state
            inits.append({})
            continue
        # The optimizer sees the master (so its state is fp32 too); it sees it as the
        # parameter itself, which some optimizers index by identity (seeds).
        compute = slot.param.data
        if k in masters:
            slot.param.data = masters[k]
        try:
            spec = optimizer.state_spec(slot.param, group)
            init = optimizer.init_state(slot.param, group)
        finally:
            slot.param.data = compute
        if k in masters:
            spec = {"master": (slot.shape, MASTER_DTYPE), **spec}
            init = {"master": masters[k], **init}
        for kind, (shape, dtype) in spec.items():
            numel, have = flat.get(kind, (0, dtype))
            if have != dtype:
                raise ValueError(f"state {kind!r} mixes dtypes {have} and {dtype} in {unit.name}")
            entry[kind] = StateSlot(kind, numel, torch.Size(shape))
            flat[kind] = (numel + _pad(max(torch.Size(shape).numel(), 1), dtype.itemsize), dtype)
        inits.append(init)
    return tuple(states), inits


def _initial_state(states: tuple[dict[str, StateSlot], ...], kind: str, lo: int, hi: int, dtype: torch.dtype,
                   inits: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """The initial value of elements [lo, hi) of state ``kind``'s flat buffer (one piece, or the
    whole), or None when it is all zeros (Adam's moments: the store then starts it as zeros,
    with no I/O). Built a piece at a time: an 8B embedding's fp32 master is 2 GiB whole."""
    values = [(entry[kind], init[kind]) for entry, init in zip(states, inits)
              if kind in entry and init[kind].any()]
    if not values:
        return None
    flat = torch.zeros(hi - lo, dtype=dtype)
    for s, value in values:
        a, b = max(lo, s.offset), min(hi, s.offset + s.shape.numel())
        if a < b:
            flat[a - lo:b - lo] = value.reshape(-1)[a - s.offset:b - s.offset]
    return flat
