"""What a unit's optimizer state takes, how it splits into pieces, and the arenas a run
needs — computed from the optimizer's ``state_spec`` before anything is allocated, so the
store can be sized first (``training.offload_model``) and ``unit_layout.store_unit`` lays
the state out to match.

Arena budgets are the *working set* the engine needs, not the machine's size: arenas are
preallocated and touched (their budget is physically real), so a budget larger than the
need would only waste RAM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .directio import align_up
from .handle import Tier
from .nf4 import NF4Layout
from .units import GRADS, Unit, _pad


#: piece boundaries fall on multiples of this many elements: whole 8-bit quantization
#: blocks (256) and whole pages of every dtype
PIECE_ALIGN = 4096


@dataclass
class StatePieces:
    """How a unit's optimizer state is split (see :func:`state_pieces`)."""

    ranges: list[tuple[int, int]]  # element ranges [a, b) of the unit's trainable parameter
    ratios: dict[str, int]  # kind -> parameter elements per state element; 0: kept whole
    handle_bytes: dict[str, int]  # kind -> bytes of its largest handle (a piece, or the whole)


def state_pieces(unit: Unit, optimizer, piece_bytes: int | None, master_weights: bool = True
                 ) -> StatePieces | None:
    """How to split ``unit``'s optimizer state into pieces of about ``piece_bytes``, if at all.

    A unit is split when it has one trainable parameter, its state is over 1.5 x
    ``piece_bytes`` and the optimizer updates element-wise
    (``OutcoreOptimizer.elementwise_state``): updating elements [a, b) with the state
    of [a, b) then gives the same bits as updating the whole.
    """
    train = [s for s in unit.slots if s.param.requires_grad]
    ratios_of = getattr(optimizer, "elementwise_state", None)
    if not piece_bytes or len(train) != 1 or ratios_of is None:
        return None
    slot = train[0]
    state = unit_state_bytes([unit], optimizer, master_weights)[0]
    total = sum(state.values())
    if total <= 1.5 * piece_bytes:
        return None
    group = optimizer.param_groups[0]
    target = slot.param
    if master_weights and needs_master(slot.param):
        target = torch.empty(slot.shape, dtype=MASTER_DTYPE, device="meta")
    ratios = ratios_of(target, group)
    if ratios is None:
        return None
    if master_weights and needs_master(slot.param):
        ratios = {"master": 1, **ratios}
    if set(ratios) != set(state) or any(r and PIECE_ALIGN % r for r in ratios.values()):
        return None
    n = slot.numel
    count = -(-total // piece_bytes)
    step = -(-n // count // PIECE_ALIGN) * PIECE_ALIGN
    bounds = list(range(0, n, step)) + [n]
    ranges = list(zip(bounds, bounds[1:]))
    spec = optimizer.state_spec(target, group)
    itemsize = {"master": MASTER_DTYPE.itemsize, **{k: dtype.itemsize for k, (_, dtype) in spec.items()}}
    handle_bytes = {k: state[k] if not r else max(-(-b // r) - a // r for a, b in ranges) * itemsize[k]
                    for k, r in ratios.items()}
    return StatePieces(ranges, ratios, handle_bytes)


def needs_master(param: torch.Tensor) -> bool:
    """Does this parameter train in 16 bits (so mixed precision keeps an fp32 master)?"""
    return param.requires_grad and param.dtype in (torch.bfloat16, torch.float16)


MASTER_DTYPE = torch.float32


def unit_state_bytes(units: list[Unit], optimizer, master_weights: bool = True,
                     spill_grads: bool = False) -> list[dict[str, int]]:
    """Bytes of each optimizer-state handle (kind -> bytes) per unit, from ``state_spec``
    (and the fp32 masters of mixed precision, see ``StoreUnitMemory``; and with
    ``spill_grads`` the spilled gradient, which streams with the state).

    Nothing is allocated: this sizes the store before anything is registered. Without an
    optimizer (zeroth-order) there is no state.
    """
    if optimizer is None:
        return [{} for _ in units]
    group = optimizer.param_groups[0]
    out = []
    for unit in units:
        kinds: dict[str, int] = {}
        for slot in unit.slots:
            if not slot.param.requires_grad:
                continue
            target = slot.param
            spec = {}
            if master_weights and needs_master(slot.param):
                target = torch.empty(slot.shape, dtype=MASTER_DTYPE, device="meta")
                spec["master"] = (slot.shape, MASTER_DTYPE)
            spec.update(optimizer.state_spec(target, group))
            for kind, (shape, dtype) in spec.items():
                n = _pad(max(torch.Size(shape).numel(), 1), dtype.itemsize) * dtype.itemsize
                kinds[kind] = kinds.get(kind, 0) + n
        if spill_grads and kinds:
            kinds[GRADS] = unit.numel * _unit_dtype(unit).itemsize
        out.append(kinds)
    return out


def _unit_dtype(unit: Unit) -> torch.dtype:
    dtypes = {s.param.dtype for s in unit.slots}
    if len(dtypes) > 1:
        raise ValueError(f"unit {unit.name} mixes parameter dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop() if dtypes else torch.float32


def window_bytes(sizes: list[int], count: int) -> int:
    """The largest of ``sizes`` plus ``count`` of the second largest (an embedding is far larger
    than a block, and only one of it is ever in flight): how the engine sizes its DEVICE and
    HOST arenas (``training.offload_model``) and the plan its windows (``plan_layout``)."""
    top = sorted(sizes, reverse=True) + [0, 0]
    return top[0] + count * top[1]


@dataclass
class WorkingSet:
    """The arenas a run needs (see :func:`working_set`)."""

    device: int  # DEVICE arena bytes
    host: int  # HOST arena bytes
    piece_bytes: int | None  # split a unit's state larger than this into pieces (None: never)


def _arena_bytes(handle_bytes: int | dict[str, int]) -> int:
    """What one unit's handle(s) take in an arena: each handle 4 KiB-padded."""
    sizes = handle_bytes.values() if isinstance(handle_bytes, dict) else [handle_bytes]
    return sum(align_up(max(n, 1)) for n in sizes)


def weights_arena_bytes(unit: Unit, quantize_frozen: bool = False) -> int:
    """What a unit's weights take in an arena: its flat buffer (NF4 bytes when its frozen
    matrices are stored quantized), 4 KiB-padded."""
    if quantize_frozen and NF4Layout.any_quantized(unit):
        return _arena_bytes(NF4Layout(unit, _unit_dtype(unit)).nbytes)
    return _arena_bytes(unit.numel * _unit_dtype(unit).itemsize)


def working_set(units: list[Unit], optimizer, homes: list[tuple[Tier, Tier]], k: int, *,
                master_weights: bool, spill_grads: bool, quantize_frozen: bool, split_state: bool
                ) -> WorkingSet:
    """The DEVICE and HOST arena bytes the engine needs with ``k`` units prefetched.

    DEVICE: at the turn of the step the engine wants the unit computing, its borrowed (tied)
    weights, k prefetched and k+1 kept for the next phase: 2k + 3 units. Kept units are only
    a wish (evicted, oldest first, when a fetch needs the room), so the window is 2k + 2
    units: the largest once, the rest at the second size. HOST: the units whose home is
    HOST, and the optimizer state streaming through: the unit updating and k prefetched (a
    copy still writing back is evicted when its write lands; the arena allocates large
    blocks from the top, so the embedding's state and the blocks' do not fragment each
    other). A unit whose streamed state dwarfs a block's (the embedding) streams it in
    block-sized pieces when the optimizer is element-wise (its spilled gradient too).
    """
    w_sizes = [weights_arena_bytes(u, quantize_frozen) for u in units]
    s_sizes = [_arena_bytes(kinds) for kinds in unit_state_bytes(units, optimizer, master_weights, spill_grads)]
    piece_bytes = None if not split_state or len(s_sizes) < 2 else sorted(s_sizes)[-2]
    window_sizes = list(s_sizes)
    for i, unit in enumerate(units):
        split = state_pieces(unit, optimizer, piece_bytes, master_weights) if homes[i][1] is Tier.NVME else None
        if split is not None:
            grads = {}
            if spill_grads:
                elems = max(b - a for a, b in split.ranges)
                grads = {GRADS: elems * _unit_dtype(unit).itemsize}
            window_sizes[i] = _arena_bytes({**split.handle_bytes, **grads})
    host_home = sum(w for w, (hw, _) in zip(w_sizes, homes) if hw is Tier.HOST)
    host_home += sum(s for s, (_, hs) in zip(s_sizes, homes) if hs is Tier.HOST)
    streams = any(hs is Tier.NVME for _, hs in homes)
    return WorkingSet(device=window_bytes(w_sizes, 2 * k + 1),
                      host=host_home + (window_bytes(window_sizes, k + 1) if streams else 0),
                      piece_bytes=piece_bytes)
