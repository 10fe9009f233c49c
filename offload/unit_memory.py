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
from .units import ParamSlot, Unit, _pad

WEIGHTS = "w"
GRADS = "g"  # a unit's spilled gradients (same layout as its weights)


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
    """

    def __init__(self, store: TieredStore, units: list[Unit], optimizer, home: Tier = Tier.NVME,
                 homes: list[tuple[Tier, Tier]] | None = None,
                 init_weights: Callable[[ParamSlot, torch.Tensor], None] | None = None,
                 master_weights: bool = True, quantize_frozen: bool = False):
        self.store = store
        self.units = units
        self.homes = homes or [(Tier.parse(home), Tier.parse(home))] * len(units)
        self.handles: dict[tuple[int, str], TensorHandle] = {}
        self.state_layout: list[list[dict[str, _StateSlot]]] = []
        self.unit_kinds: list[list[str]] = []  # per unit, its state tensor classes
        self.nf4: dict[int, NF4Layout] = {}  # quantized units (QLoRA)
        self._decoded: dict[int, torch.Tensor] = {}  # quantized unit -> its dequantized weights
        group = optimizer.param_groups[0]
        for unit in units:
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
            w_home, s_home = self.homes[unit.index]
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
            for kind, numel in sizes.items():
                parts = [(entry[kind], init[kind]) for entry, init in zip(layout, inits)
                         if kind in entry and init[kind].any()]
                if not parts:  # all zeros (Adam moments): the store starts it as zeros, no I/O
                    self.handles[(unit.index, kind)] = store.register(
                        f"{unit.name}:{kind}", shape=(numel,), dtype=dtypes[kind], home=s_home)
                    continue
                flat = torch.zeros(numel, dtype=dtypes[kind])
                for s, value in parts:
                    flat[s.offset:s.offset + s.shape.numel()].view(s.shape).copy_(value)
                self.handles[(unit.index, kind)] = store.register(f"{unit.name}:{kind}", data=flat,
                                                                  home=s_home)
            del masters, inits
            self.state_layout.append(layout)
            self.unit_kinds.append(list(sizes))
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

    def drop_grads(self, unit: int) -> None:
        """Forget a unit's spilled gradient (its update has consumed it)."""
        h = self.handles.pop((unit, GRADS), None)
        if h is not None:
            self._unpinned.pop((unit, GRADS), None)
            self.store.unregister(h)

    def state_views(self, unit: int, flats: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """Optimizer state of the unit's ``k``-th parameter as views into the fetched flats."""
        return {kind: flats[kind][s.offset:s.offset + s.shape.numel()].view(s.shape)
                for kind, s in self.state_layout[unit][k].items()}

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
        return self.store.load(self.handles[(unit, kind)])

    def overwrite(self, unit: int, kind: str, value: torch.Tensor) -> None:
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


def needs_master(param: torch.Tensor) -> bool:
    """Does this parameter train in 16 bits (so mixed precision keeps an fp32 master)?"""
    return param.requires_grad and param.dtype in (torch.bfloat16, torch.float16)


MASTER_DTYPE = torch.float32


def unit_state_bytes(units: list[Unit], optimizer, master_weights: bool = True,
                     spill_grads: bool = False) -> list[dict[str, int]]:
    """Bytes of each optimizer-state handle (kind -> bytes) per unit, from ``state_spec``
    (and the fp32 masters of mixed precision, see ``StoreUnitMemory``; and with
    ``spill_grads`` the spilled gradient, which streams with the state).

    Nothing is allocated: this sizes the store before anything is registered.
    """
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
