"""The engine's unit buffers kept in a :class:`TieredStore`.

Each unit of the model (see ``units.py``) has one handle for its weights and
one per optimizer-state tensor class (``exp_avg``, ``exp_avg_sq``, ``step`` …),
each a flat buffer with every parameter's piece back to back. Weights are
computed on in DEVICE; optimizer state is updated in HOST (the CPU runs the
update). The authoritative copies live in the ``home`` tier (NVME or HOST).

Residency policy (the order of a step is static, so no guessing): the engine
prefetches what comes next and, on release, says whether the unit is needed
again soon (``keep``); a released unit that is not kept is evicted at once —
written back first when dirty, asynchronously. If a fetch still finds its tier
full, unpinned copies are evicted oldest-first and the fetch is retried; only
when nothing unpinned is left does the budget error reach the user.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import BudgetError
from .handle import TensorHandle, Tier
from .store import TieredStore
from .nf4 import NF4Layout
from .unit_sizes import GRADS, MASTER_DTYPE, _unit_dtype, needs_master, state_pieces
from .units import ParamSlot, Unit, _pad

WEIGHTS = "w"


@dataclass
class _StateSlot:
    kind: str  # state tensor class, also the handle's suffix
    offset: int  # elements into the flat buffer
    shape: torch.Size


class StoreUnitMemory:
    """``UnitMemory`` (see ``engine.py``) backed by a TieredStore.

    Args:
        store: the tiered store (its budgets bound everything here).
        units: the model's units; their parameters still hold the initial weights.
        optimizer: an ``OutcoreOptimizer``: ``state_spec`` gives the state layout and
            ``init_state`` the initial values.
        home: tier of the authoritative copies (``Tier.NVME`` or ``Tier.HOST``).
        homes: per unit, (weights home, state home); overrides ``home``.
        init_weights: fills a parameter's weights ``(slot, view [shape])`` when the
            model was built on the meta device: each unit is then materialized
            here, one at a time, so the whole model never sits in RAM.
        master_weights: mixed precision: when a trainable parameter computes in 16 bits,
            keep an fp32 master copy as optimizer state (kind ``master``, in the state
            tier); the optimizer updates the master, the engine rounds it into the
            16-bit weights. ``init_weights`` then fills the master, in fp32.
        state_piece_bytes: split the state of a unit larger than this (an embedding: 49152
            x 576 fp32 Adam moments are 216 MiB, a block's 27 MiB) into pieces of about
            this size, each its own handle (kind ``exp_avg@3``), when the optimizer
            updates element-wise (see :func:`state_pieces`); the engine then updates the
            unit piece by piece and the HOST window holds one piece, not the whole state.
            None: never split.
    """

    def __init__(self, store: TieredStore, units: list[Unit], optimizer, home: Tier = Tier.NVME,
                 homes: list[tuple[Tier, Tier]] | None = None,
                 init_weights: Callable[[ParamSlot, torch.Tensor], None] | None = None,
                 master_weights: bool = True, quantize_frozen: bool = False,
                 state_piece_bytes: int | None = None):
        self.store = store
        self.units = units
        self.homes = homes or [(Tier.parse(home), Tier.parse(home))] * len(units)
        self.handles: dict[tuple[int, str], TensorHandle] = {}
        self.state_layout: list[list[dict[str, _StateSlot]]] = []
        self.unit_kinds: list[list[str]] = []  # per unit, its state tensor classes
        self.nf4: dict[int, NF4Layout] = {}  # quantized units (QLoRA)
        self._decoded: dict[int, torch.Tensor] = {}  # quantized unit -> its dequantized weights
        # pieced units: unit -> element ranges of its one trainable parameter, and
        # kind -> parameter elements per state element (0: the kind stays whole)
        self.pieces: dict[int, list[tuple[int, int]]] = {}
        self.piece_ratios: dict[int, dict[str, int]] = {}
        self._flat_layout: dict[tuple[int, str], tuple[int, torch.dtype]] = {}  # (unit, kind) -> numel, dtype
        group = optimizer.param_groups[0]
        for unit in units:
            w_home, s_home = self.homes[unit.index]
            # state at home in HOST is not streamed: splitting it would save nothing
            split = state_pieces(unit, optimizer, state_piece_bytes, master_weights) if s_home is Tier.NVME else None
            if split is not None:
                self.pieces[unit.index], self.piece_ratios[unit.index] = split.ranges, split.ratios
            w = torch.empty(unit.numel, dtype=_unit_dtype(unit))
            masters: dict[int, torch.Tensor] = {}  # slot index -> fp32 master (mixed precision)
            for k, slot in enumerate(unit.slots):
                wants_master = master_weights and needs_master(slot.param)
                if wants_master:
                    masters[k] = torch.empty(slot.shape, dtype=MASTER_DTYPE)
                if slot.param.is_meta:
                    if init_weights is None:
                        raise ValueError(f"{slot.name} is on the meta device and no init_weights was given")
                    if wants_master:
                        init_weights(slot, masters[k])
                        unit.view(w, slot).copy_(masters[k])  # round to nearest, as .to() does
                    else:
                        init_weights(slot, unit.view(w, slot))
                    # The optimizer's state_spec/init_state below need a real tensor, and
                    # `.data =` cannot move a parameter off the meta device: swap its
                    # contents (the Parameter object, held by the optimizer and by tied
                    # modules, stays the same).
                    torch.utils.swap_tensors(slot.param, torch.nn.Parameter(
                        unit.view(w, slot), requires_grad=slot.param.requires_grad))
                else:
                    unit.view(w, slot).copy_(slot.param.data)
                    if wants_master:
                        masters[k].copy_(slot.param.data)
            if quantize_frozen and NF4Layout.any_quantized(unit):
                layout4 = self.nf4[unit.index] = NF4Layout(unit, w.dtype)
                w4 = torch.zeros(layout4.nbytes, dtype=torch.uint8)
                for k, slot in enumerate(unit.slots):
                    layout4.encode(k, unit.view(w, slot), w4)
                w = w4
            self.handles[(unit.index, WEIGHTS)] = store.register(f"{unit.name}:w", data=w, home=w_home)
            del w
            layout, sizes, dtypes = [], {}, {}
            inits: list[dict[str, torch.Tensor]] = []
            for k, slot in enumerate(unit.slots):
                if not slot.param.requires_grad:  # frozen: read-only weights, no optimizer state
                    layout.append({})
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
                entry = {}
                for kind, (shape, dtype) in spec.items():
                    dtypes.setdefault(kind, dtype)
                    if dtypes[kind] != dtype:
                        raise ValueError(f"state {kind!r} mixes dtypes {dtypes[kind]} and {dtype} in {unit.name}")
                    n = torch.Size(shape).numel()
                    entry[kind] = _StateSlot(kind, sizes.get(kind, 0), torch.Size(shape))
                    sizes[kind] = sizes.get(kind, 0) + _pad(max(n, 1), dtype.itemsize)
                layout.append(entry)
                inits.append(init)
            self._flat_layout[(unit.index, WEIGHTS)] = (self.handles[(unit.index, WEIGHTS)].numel,
                                                        self.handles[(unit.index, WEIGHTS)].dtype)
            for kind, numel in sizes.items():
                self._flat_layout[(unit.index, kind)] = (numel, dtypes[kind])
                parts = [(entry[kind], init[kind]) for entry, init in zip(layout, inits)
                         if kind in entry and init[kind].any()]
                flat = None  # all zeros (Adam moments): the store starts it as zeros, no I/O
                if parts:
                    flat = torch.zeros(numel, dtype=dtypes[kind])
                    for s, value in parts:
                        flat[s.offset:s.offset + s.shape.numel()].view(s.shape).copy_(value)
                for name, lo, hi in self._kind_ranges(unit.index, kind, numel):
                    self.handles[(unit.index, name)] = store.register(
                        f"{unit.name}:{name}", home=s_home, shape=None if parts else (hi - lo,),
                        dtype=None if parts else dtypes[kind], data=None if flat is None else flat[lo:hi].clone())
                del flat
            del masters, inits
            self.state_layout.append(layout)
            ratios = self.piece_ratios.get(unit.index, {})
            self.unit_kinds.append([kind for kind in sizes if not ratios.get(kind)])
            for slot in unit.slots:  # the store holds the unit now: free the model's own copy
                slot.param.data = torch.empty(0, dtype=slot.param.dtype)
        self._pinned: dict[tuple[int, str], Future] = {}  # fetched and not yet released
        self._unpinned: OrderedDict[tuple[int, str], None] = OrderedDict()  # resident, evictable (LRU)
        self._writes: list[Future] = []

    # -- the UnitMemory protocol ----------------------------------------------------
    def _tier(self, kind: str) -> Tier:
        return Tier.DEVICE if kind == WEIGHTS else Tier.HOST

    def _home(self, key: tuple[int, str]) -> Tier:
        return self.handles[key].home

    def prefetch(self, unit: int, kind: str) -> None:
        key = (unit, kind)
        if key not in self.handles or key in self._pinned:
            return
        try:
            self._pin(key)
        except BudgetError:
            pass  # no room to run ahead now; acquire() fetches it when it is needed

    def acquire(self, unit: int, kind: str) -> torch.Tensor:
        key = (unit, kind)
        fut = self._pinned.get(key) or self._pin(key)
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()  # the consumer stalls on I/O here
            self.stall_s += time.perf_counter() - t0
        if kind == WEIGHTS and unit in self.nf4:
            if unit not in self._decoded:
                self._decoded[unit] = self._decode(unit, fut.result())
            return self._decoded[unit]
        return fut.result()

    def _decode(self, unit: int, raw: torch.Tensor) -> torch.Tensor:
        layout = self.nf4[unit]
        return layout.decode(raw, torch.empty(self.units[unit].numel, dtype=layout.dtype))

    def before_update(self, unit: int, kind: str) -> None:
        """Wait for an earlier write-back of this copy: it must not change under the disk's read."""
        h = self.handles[(unit, kind)]
        f = h.copies[self._tier(kind)].future
        if f is not None and not f.done():
            t0 = time.perf_counter()
            f.result()
            self.stall_s += time.perf_counter() - t0

    def release(self, unit: int, kind: str, dirty: bool, keep: bool = False) -> None:
        key = (unit, kind)
        self._reap()
        h, tier = self.handles[key], self._tier(kind)
        self._pinned.pop(key)
        if kind == WEIGHTS and unit in self.nf4:
            if dirty:
                raise ValueError(f"unit {unit} holds NF4-quantized frozen weights; they cannot be updated")
            del self._decoded[unit]  # freed once no parameter points at it any more
        if dirty:
            self.store.mark_dirty(h, tier)
            if tier is not h.home:
                self._writes.append(self.store.write_back(h))
        self.store.release(h, tier)
        if tier is h.home:
            return
        if keep:
            self._unpinned[key] = None
        else:
            self._writes.append(self.store.evict(h, tier))

    # -- gradients spilled to disk (clipping / accumulation out of core) -----------------
    def spill_grads(self, unit: int, grads: dict[int, torch.Tensor], first: bool) -> torch.Tensor:
        """Add a unit's gradients (slot index -> grad) into its spilled gradient, on the state's home.

        The first spill of a step registers a fresh handle: its first fetch is zeros
        with no read, and it is *copied* into (not added: ``0 + -0.0`` would lose the sign
        bit the in-memory gradient keeps). Later micro-batches fetch and add, as
        autograd's accumulation does (``old + new``). Returns the pinned working copy;
        the caller reads what it needs and calls ``release(unit, GRADS, dirty=True)``.
        """
        if unit in self.pieces:
            self._spill_pieces(unit, grads, first)
            return None
        key = (unit, GRADS)
        u = self.units[unit]
        if first:
            dtype = _unit_dtype(u)
            self.handles[key] = self.store.register(f"{u.name}:{GRADS}", shape=(u.numel,), dtype=dtype,
                                                    home=self.homes[unit][1])
        flat = self.acquire(unit, GRADS)
        for k, g in grads.items():
            view = u.view(flat, u.slots[k])
            view.copy_(g) if first else view.add_(g)
        return flat

    def _spill_pieces(self, unit: int, grads: dict[int, torch.Tensor], first: bool) -> None:
        """``spill_grads`` of a pieced unit: its one gradient written a piece at a time
        (kinds ``g@i``). A later micro-batch adds each spilled piece into the gradient in
        place first (``old + new``, autograd's order), so the gradient holds the total the
        caller takes the norm of."""
        (g,) = grads.values()
        flat, u = g.view(-1), self.units[unit]
        pieces = self.pieces[unit]
        for i, (a, b) in enumerate(pieces):
            kind = f"{GRADS}@{i}"
            if first:
                self.handles[(unit, kind)] = self.store.register(f"{u.name}:{kind}", shape=(b - a,), dtype=g.dtype,
                                                                 home=self.homes[unit][1])
            elif i + 1 < len(pieces):
                self.prefetch(unit, f"{GRADS}@{i + 1}")
            piece = self.acquire(unit, kind)
            if not first:
                torch.add(piece, flat[a:b], out=flat[a:b])
            piece.copy_(flat[a:b])
            self.release(unit, kind, dirty=True)  # written home and evicted, asynchronously

    def drop_grads(self, unit: int) -> None:
        """Forget a unit's spilled gradient (its update has consumed it)."""
        kinds = [f"{GRADS}@{i}" for i in range(len(self.pieces[unit]))] if unit in self.pieces else [GRADS]
        for kind in kinds:
            h = self.handles.pop((unit, kind), None)
            if h is not None:
                self._unpinned.pop((unit, kind), None)
                self.store.unregister(h)

    def state_views(self, unit: int, flats: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """Optimizer state of the unit's ``k``-th parameter as views into the fetched flats."""
        return {kind: flats[kind][s.offset:s.offset + s.shape.numel()].view(s.shape)
                for kind, s in self.state_layout[unit][k].items()}

    # -- pieced units (see state_pieces) -------------------------------------------------
    def _kind_ranges(self, unit: int, kind: str, numel: int) -> list[tuple[str, int, int]]:
        """(handle kind, first, end) of the state elements of ``kind``: one range, or one per piece."""
        ratio = self.piece_ratios.get(unit, {}).get(kind)
        if not ratio:
            return [(kind, 0, numel)]
        return [(f"{kind}@{i}", a // ratio, -(-b // ratio)) for i, (a, b) in enumerate(self.pieces[unit])]

    def piece_kinds(self, unit: int, piece: int) -> list[str]:
        """The handle kinds of piece ``piece`` of a pieced unit's state (and of its spilled
        gradient, while one is registered)."""
        kinds = [f"{kind}@{piece}" for kind, ratio in self.piece_ratios[unit].items() if ratio]
        return kinds + ([f"{GRADS}@{piece}"] if (unit, f"{GRADS}@{piece}") in self.handles else [])

    def piece_state(self, unit: int, k: int, piece: int, whole: dict[str, torch.Tensor],
                    part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The optimizer state of elements ``pieces[unit][piece]`` of the unit's ``k``-th
        parameter: its own pieces (``part``, by handle kind) and the whole kinds (``whole``)."""
        ratios, layout = self.piece_ratios[unit], self.state_layout[unit][k]
        return {kind: part[f"{kind}@{piece}"] if ratios[kind]
                else whole[kind][s.offset:s.offset + s.shape.numel()].view(s.shape)
                for kind, s in layout.items()}

    def kinds(self, unit: int) -> list[str]:
        """Every state kind of ``unit`` (pieced or not), in ``state_spec`` order."""
        layout = self.state_layout[unit]
        return list(dict.fromkeys(kind for entry in layout for kind in entry))

    def kind_layout(self, unit: int, kind: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of the flat buffer of ``kind`` (``w`` or a state kind) as
        :meth:`state` returns it, pieced or not."""
        numel, dtype = self._flat_layout[(unit, kind)]
        return (numel,), dtype

    # -- internals --------------------------------------------------------------------
    stall_s = 0.0

    def _pin(self, key: tuple[int, str]) -> Future:
        h, tier = self.handles[key], self._tier(key[1])
        self._unpinned.pop(key, None)
        while True:
            try:
                fut = self.store.fetch(h, tier)
                break
            except BudgetError:
                if not self._evict_one(tier):
                    raise
        self._pinned[key] = fut
        return fut

    def _evict_one(self, tier: Tier) -> bool:
        """Evict the least recently released unpinned copy in ``tier``; False if none."""
        for key in list(self._unpinned):
            if self._tier(key[1]) is tier:
                del self._unpinned[key]
                self.store.evict(self.handles[key], tier).result()  # must be free before retrying
                return True
        # Evictions started on release may still be writing back: wait for them to free.
        pending = [f for f in self._writes if not f.done()]
        for f in pending:
            f.result()
        self._writes.clear()
        return bool(pending)

    def _reap(self) -> None:
        """Drop finished write-backs, raising the first error (a full disk, an I/O error)."""
        done = [f for f in self._writes if f.done()]
        self._writes = [f for f in self._writes if not f.done()]
        for f in done:
            f.result()

    def flush(self) -> None:
        """Wait until every write-back is done (the step's updates are durable in their tier)."""
        for f in self._writes:
            f.result()
        self._writes.clear()

    def weights(self, unit: int) -> torch.Tensor:
        """A CPU copy of a unit's newest weights (for checkpoints and tests; blocks), dequantized
        when stored in NF4."""
        raw = self.store.load(self.handles[(unit, WEIGHTS)])
        return self._decode(unit, raw) if unit in self.nf4 else raw

    def state(self, unit: int, kind: str) -> torch.Tensor:
        """A CPU copy of the unit's state ``kind`` (a pieced kind's pieces joined)."""
        if not self.piece_ratios.get(unit, {}).get(kind):
            return self.store.load(self.handles[(unit, kind)])
        numel, dtype = self._flat_layout[(unit, kind)]
        out = torch.zeros(numel, dtype=dtype)  # the padding after the last piece stays zero
        for name, lo, hi in self._kind_ranges(unit, kind, numel):
            out[lo:hi] = self.store.load(self.handles[(unit, name)])
        return out

    def overwrite(self, unit: int, kind: str, value: torch.Tensor) -> None:
        """Replace the unit's state ``kind`` (or its weights, ``w``): see :meth:`_overwrite`."""
        if kind != WEIGHTS and self.piece_ratios.get(unit, {}).get(kind):
            for name, lo, hi in self._kind_ranges(unit, kind, 0):
                self._overwrite(unit, name, value.reshape(-1)[lo:hi])
            return
        self._overwrite(unit, kind, value)

    def _overwrite(self, unit: int, kind: str, value: torch.Tensor) -> None:
        """Replace a handle's value (resume from a checkpoint): through a pinned working copy,
        marked dirty and written home, so every tier agrees afterwards."""
        key = (unit, kind)
        h, tier = self.handles[key], self._tier(kind)
        self.store.fetch(h, tier).result().copy_(value.view(h.shape))
        self.store.mark_dirty(h, tier)
        if tier is not h.home:
            self.store.write_back(h).result()
        self.store.release(h, tier)
        if tier is not h.home:
            self.store.evict(h, tier).result()
            self._unpinned.pop(key, None)
