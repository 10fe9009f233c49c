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

from ..aligned import align_up
from ..store import Tier
from .nf4 import NF4Layout
from .units import GRADS, Piece, Unit, _pad


#: piece boundaries fall on multiples of this many elements: whole 8-bit quantization
#: blocks (256) and whole pages of every dtype
PIECE_ALIGN = 4096
#: a state kind this small a share of its unit's state stays in RAM when the rest streams
#: from NVMe (:func:`ram_kinds`)
RAM_KIND_SHARE = 1 / 64


def ram_kinds(kind_bytes: dict[str, int]) -> set[str]:
    """The state kinds of a unit kept in RAM (HOST) when its state's home is NVMe: those of at
    most ``RAM_KIND_SHARE`` of the unit's state — AdamW8bit's block scales (``m_absmax``,
    ``v_absmax``: 8 B per 256 elements, 1/64 of the codes), step counts, a norm's fp32 moments.
    Reading and writing them every step would cost 0.8% more bytes than the codes for no
    RAM worth saving (an 8B model's scales: ~250 MB), and would keep bf16-lean + AdamW8bit
    above 4 bytes written per parameter per step."""
    total = sum(kind_bytes.values())
    return {kind for kind, n in kind_bytes.items() if n <= total * RAM_KIND_SHARE}


@dataclass
class StatePieces:
    """How a unit's optimizer state is split (see :func:`state_pieces`)."""

    pieces: list[Piece]  # in order: ranges of the unit's trainable elements, their segments and spans
    ratios: dict[str, int]  # kind -> parameter elements per state element; 0: kept whole
    handle_bytes: dict[str, int]  # kind -> bytes of its largest handle (a piece, or the whole)
    stored: int = 0  # arena bytes of all its handles (a shard's state: ~1/world of the unit's)


def state_pieces(unit: Unit, optimizer, piece_bytes: int | None, master_weights: bool = True
                 ) -> StatePieces | None:
    """How to split ``unit``'s optimizer state into pieces of about ``piece_bytes``, if at all.

    A unit is split when its state is over 1.5 x ``piece_bytes`` and the optimizer updates
    every trainable parameter of it element-wise, alike (``OutcoreOptimizer.elementwise_state``
    gives each the same ratios): updating elements [a, b) with the state of [a, b) then gives
    the same bits as updating the whole. The pieces are ranges of the unit's trainable
    elements, the slots taken in order (an embedding's one matrix; a mixture-of-experts
    block's experts, attention and norms); a piece ends inside a slot only on a multiple of
    ``PIECE_ALIGN`` of it, so each piece's state is one contiguous range of each flat buffer.
    A sharded unit (``unit.shard``: data parallel) is always split, and its pieces cover only
    this rank's range (none when the range holds no element).
    """
    train = [k for k, s in enumerate(unit.slots) if s.param.requires_grad]
    ratios_of = getattr(optimizer, "elementwise_state", None)
    if not (piece_bytes or unit.shard) or not train or ratios_of is None:
        return None
    state = unit_state_bytes([unit], optimizer, master_weights)[0]
    spans = unit.shard.spans if unit.shard else [(k, 0, unit.slots[k].numel) for k in train]
    n, mine = sum(unit.slots[k].numel for k in train), sum(hi - lo for _, lo, hi in spans)
    total = sum(state.values()) * mine // n  # this rank's share of the state
    if not unit.shard and total <= 1.5 * piece_bytes:
        return None
    group = optimizer.param_groups[0]
    specs, ratios = [], {}
    for k in train:
        target, param = unit.slots[k].param, unit.slots[k].param
        if master_weights and needs_master(param):
            target = torch.empty(unit.slots[k].shape, dtype=MASTER_DTYPE, device="meta")
        own = ratios_of(target, group)
        # one rank's pieces: every tensor alike; a shard's may mix kinds (AdamW8bit's small
        # tensors keep fp32 moments), each kind with one ratio
        if own is None or any(ratios.get(kind, r) != r for kind, r in own.items()) or (
                not unit.shard and ratios and own != ratios):
            return None
        ratios.update(own)
        spec = optimizer.state_spec(target, group)
        if master_weights and needs_master(param):
            spec = {"master": (unit.slots[k].shape, MASTER_DTYPE), **spec}
        specs.append(spec)
    if master_weights and needs_master(unit.slots[train[0]].param):
        ratios = {"master": 1, **ratios}
    if set(ratios) != set(state) or any(r and PIECE_ALIGN % r for r in ratios.values()):
        return None
    count = -(-total // piece_bytes) if piece_bytes and total > 1.5 * piece_bytes else 1
    ranges, segments = _cut(unit, train, spans, max(PIECE_ALIGN, -(-mine // count // PIECE_ALIGN) * PIECE_ALIGN))
    spans_of, handle_bytes, stored = {}, {}, 0
    for kind, r in ratios.items():
        if not r:
            handle_bytes[kind] = state[kind]
            stored += _arena_bytes(state[kind])
            continue
        spans_of[kind] = _kind_spans(kind, r, train, specs, segments)
        dtype = next(spec[kind][1] for spec in specs if kind in spec)
        handle_bytes[kind] = max((hi - lo for lo, hi in spans_of[kind]), default=0) * dtype.itemsize
        stored += sum(_arena_bytes((hi - lo) * dtype.itemsize) for lo, hi in spans_of[kind] if lo < hi)
    pieces = [Piece(a, b, tuple(seg), {kind: per_piece[i] for kind, per_piece in spans_of.items()})
              for i, ((a, b), seg) in enumerate(zip(ranges, segments))]
    return StatePieces(pieces, ratios, handle_bytes, stored)


def _kind_spans(kind: str, ratio: int, train: list[int], specs: list[dict], segments: list[list[tuple[int, int, int]]]
                ) -> list[tuple[int, int]]:
    """Per piece, its range of ``kind``'s flat buffer (the slots that have the kind laid out in
    slot order, as ``unit_layout`` lays them); empty (lo == hi) for a piece without the kind."""
    offsets, at = {}, 0
    for k, spec in zip(train, specs):
        if kind in spec:
            offsets[k] = at
            at += _pad(max(torch.Size(spec[kind][0]).numel(), 1), spec[kind][1].itemsize)
    out = []
    for seg in segments:
        mine = [s for s in seg if s[0] in offsets]
        out.append((offsets[mine[0][0]] + mine[0][1] // ratio, offsets[mine[-1][0]] + -(-mine[-1][2] // ratio))
                   if mine else (0, 0))
    return out


def _cut(unit: Unit, train: list[int], spans: list[tuple[int, int, int]], step: int
         ) -> tuple[list[tuple[int, int]], list[list[tuple[int, int, int]]]]:
    """Pieces of about ``step`` trainable elements covering ``spans`` ((slot, lo, hi), in slot
    order): their ranges in the unit's trainable elements, and the (slot, lo, hi) each covers.
    A piece takes slots whole while they fit; it cuts a slot only at a multiple of
    ``PIECE_ALIGN`` of it (so one large slot, the embedding, is cut every ``step``)."""
    starts, at = {}, 0
    for k in train:
        starts[k], at = at, at + unit.slots[k].numel
    segments, current, filled = [], [], 0
    for k, e, n in spans:
        while e < n:
            room = step - filled
            take = n - e if n - e <= room else room // PIECE_ALIGN * PIECE_ALIGN
            if take:
                current.append((k, e, e + take))
                e, filled = e + take, filled + take
            if e < n or filled >= step:  # the slot goes on past this piece, or the piece is full
                segments.append(current)
                current, filled = [], 0
    if current:
        segments.append(current)
    ranges = [(starts[seg[0][0]] + seg[0][1], starts[seg[-1][0]] + seg[-1][2]) for seg in segments]
    return ranges, segments


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
    than a block, and only one of it is ever in flight): how the engine sizes its HOST arena
    (``assemble.offload_model``) and the plan its staging (``planner.layout``)."""
    top = sorted(sizes, reverse=True) + [0, 0]
    return top[0] + count * top[1]


def step_window(sizes: list[int], count: int, borrows: list[list[int]] | list[tuple[int, ...]]) -> int:
    """The most bytes ``count`` consecutive units of the step's order (and the units they
    borrow) take together: the DEVICE window. The engine only ever holds, prefetches or keeps
    units next to each other in that order (forward, then backward, then the next forward),
    so an untied embedding and LM head — each far larger than a block — are never both in
    it, unless the model is so shallow that ``count`` units span both.

    Args:
        sizes: each unit's bytes, in forward order.
        count: units in the window.
        borrows: per unit, the units whose weights it also needs (a tied head: the embedding).
    """
    n = len(sizes)
    best = 0
    for start in range(max(1, n - count + 1)):
        held = set(range(start, min(n, start + count)))
        held |= {j for i in list(held) for j in borrows[i]}
        best = max(best, sum(sizes[j] for j in held))
    return best


#: a state piece is at most this large: one such O_DIRECT request already reads at the disk's
#: speed, and the HOST window holds a few pieces (an 8B block's fp32 master + 8-bit moments
#: are 1.23 GiB: whole, three of them would be the HOST arena)
MAX_PIECE_BYTES = 256 << 20


def piece_size(states: list[int], blocks: list[bool]) -> int | None:
    """The size of a state piece: the second-largest block's state, at most ``MAX_PIECE_BYTES``
    (a unit's state over 1.5 x this streams in pieces: the embedding, an untied head, a
    mixture-of-experts block among dense ones, every block of a large model), or the
    second-largest unit's without blocks; None for a single unit.

    Args:
        states: each unit's state bytes.
        blocks: which units are decoder blocks.
    """
    of_blocks = sorted(s for s, b in zip(states, blocks) if b)
    sizes = of_blocks if of_blocks else sorted(states)
    if len(states) < 2:
        return None
    return min(sizes[-2] if len(sizes) >= 2 else sizes[-1], MAX_PIECE_BYTES)


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


def working_set(units: list[Unit], optimizer, homes: list[tuple[Tier, Tier, Tier]], k: int, *,
                master_weights: bool, spill_grads: bool, quantize_frozen: bool, split_state: bool,
                accelerator: bool = False, update_on_device: bool = True) -> WorkingSet:
    """The DEVICE and HOST arena bytes the engine needs with ``k`` units prefetched.

    On an ``accelerator`` the update runs there unless ``update_on_device`` is False
    (``StoreUnitMemory._tier``): the state window is in DEVICE, and HOST holds the HOST-homed
    copies plus the pinned staging of what moves between the disk and the device — a weights
    window and a state window in flight (freed as each copy lands, ``Transfers.drop_staging``).
    Updated on the host, the state window is in HOST as on a CPU-only machine, and only the
    weights are staged.

    DEVICE: at the turn of the step the engine wants the unit computing, its borrowed (tied)
    weights, k prefetched and k+1 kept for the next phase: 2k + 3 units. Kept units are only
    a wish (evicted, oldest first, when a fetch needs the room), so the window is the 2k + 2
    consecutive units (and what they borrow) that take the most (``step_window``). HOST: the units whose home is
    HOST, and the optimizer state streaming through: the unit updating and k prefetched (a
    copy still writing back is evicted when its write lands; the arena allocates large
    blocks from the top, so the embedding's state and the blocks' do not fragment each
    other). A unit whose streamed state dwarfs a block's (the embedding, an untied head) streams
    it in block-sized pieces when the optimizer is element-wise (its spilled gradient too). A
    spilled gradient homed in HOST while the state streams from disk is HOST-home bytes.
    """
    state_on_device = accelerator and update_on_device
    w_sizes = [weights_arena_bytes(u, quantize_frozen) for u in units]
    kinds_of = unit_state_bytes(units, optimizer, master_weights, spill_grads)
    s_sizes = [_arena_bytes(kinds) for kinds in kinds_of]
    world = max((u.shard.world for u in units if u.shard), default=1)  # a rank stores 1/world of each
    piece_bytes = (piece_size([-(-s // world) for s in s_sizes], [u.name.startswith("block.") for u in units])
                   if split_state else None)
    window_sizes, host_home = list(s_sizes), 0
    for i, unit in enumerate(units):
        on_disk = homes[i][1] is Tier.NVME
        streams = on_disk or state_on_device  # (on an accelerator every state streams to the update)
        ram = ram_kinds({k: n for k, n in kinds_of[i].items() if k != GRADS}) if on_disk else set()
        grads_in_ram = on_disk and spill_grads and homes[i][2] is Tier.HOST
        if grads_in_ram:
            ram.add(GRADS)
        split = state_pieces(unit, optimizer, piece_bytes, master_weights) if streams or unit.shard else None
        # the kinds kept in RAM never stream from the disk, but reach the device with the rest
        handles = {k: n for k, n in (split.handle_bytes if split else kinds_of[i]).items()
                   if k not in ram or state_on_device}
        if split is not None and spill_grads and (not grads_in_ram or state_on_device):
            handles[GRADS] = max((p.hi - p.lo for p in split.pieces), default=0) * _unit_dtype(unit).itemsize
        window_sizes[i] = _arena_bytes(handles)
        pieces = len(split.pieces) if split else 1
        host_home += sum(n + pieces * align_up(1) for k, n in kinds_of[i].items() if k in ram)
        if split is not None and unit.shard:  # the rank stores its range only (and spills its range's gradient)
            s_sizes[i] = split.stored + sum(_arena_bytes((p.hi - p.lo) * _unit_dtype(unit).itemsize)
                                            for p in split.pieces if spill_grads)
    host_home += sum(w for w, (hw, _, _) in zip(w_sizes, homes) if hw is Tier.HOST)
    host_home += sum(s for s, (_, hs, _) in zip(s_sizes, homes) if hs is Tier.HOST)
    streams = any(hs is Tier.NVME for _, hs, _ in homes)
    weights = step_window(w_sizes, 2 * k + 2, [u.borrows for u in units])
    if not state_on_device:
        state_window = window_bytes(window_sizes, k + 1) if streams else 0
        weights_disk = [w for w, (hw, _, _) in zip(w_sizes, homes) if hw is Tier.NVME]
        # the weights' staging and the state window take turns in one HOST arena; their blocks
        # interleave, so one more weights unit of room keeps a fetch from meeting only fragments
        # (a CI run on 2 loaded cores: 1.0 MiB wanted, 0.8 MiB the largest free block)
        staging = window_bytes(weights_disk, k + 1) + max(weights_disk) if accelerator and weights_disk else 0
        return WorkingSet(device=weights, host=host_home + state_window + staging, piece_bytes=piece_bytes)
    on_disk = [i for i, (hw, hs, _) in enumerate(homes) if Tier.NVME in (hw, hs)]
    staging = (window_bytes([w_sizes[i] for i in on_disk], k + 1)
               + window_bytes([window_sizes[i] for i in on_disk], k + 1)) if on_disk else 0
    return WorkingSet(device=weights + window_bytes(window_sizes, k + 1), host=host_home + staging,
                      piece_bytes=piece_bytes)
