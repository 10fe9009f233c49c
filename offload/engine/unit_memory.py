"""The units' buffers kept in a :class:`TieredStore`, and when they move.

Each unit of the model (see ``units.py``) has one handle per :class:`Part`: its
weights, each optimizer-state kind (``exp_avg``, ``exp_avg_sq``, ``step`` …, or their
pieces), its spilled gradient. Weights are computed on in DEVICE; optimizer state is
updated where the update runs: in DEVICE on an accelerator (streamed to it, in pieces when
large), in HOST on a CPU-only machine. The authoritative copies live in the unit's
home tiers (NVME or HOST). Every fact about a unit is on the unit; this class holds the
policy and the list of units, and is the one writer of each unit's ``memory`` (what is
prefetched, kept, decoded, and its spilled gradient's handles).

Residency policy (the order of a step is static, so no guessing): the engine
prefetches what comes next and, on release, says whether the unit is needed
again soon (``keep``); a released unit that is not kept is evicted at once —
written back first when dirty, asynchronously. If a fetch still finds its tier
full, kept copies are evicted least recently released first and the fetch is
retried; only when nothing unpinned is left does the budget error reach the user.

Pins: every consumer of a part holds one store pin (``TensorHandle`` copies count
them); a prefetch holds one for the consumer to come (``UnitMemoryState.prefetched``). Stalls:
waits on transfers go through the store, which counts them (``TieredStore.stall_s``).
"""
from __future__ import annotations

from concurrent.futures import Future
from itertools import count
from typing import Any, Callable

import torch

from ..._faults import fault_point
from ...errors import BudgetError
from ..store import TensorHandle, Tier, TieredStore
from .unit_layout import InitWeights, store_unit
from .unit_sizes import _unit_dtype
from .units import GRADS, WEIGHTS, Part, Unit


class StoreUnitMemory:
    """The units' buffers in a TieredStore: fetch ahead, hand out, write back, evict.

    Args:
        store: the tiered store (its budgets bound everything here).
        units: the model's units; their parameters still hold the initial weights.
        optimizer: an ``OutcoreOptimizer`` (``state_spec`` gives the state layout and
            ``init_state`` the initial values), or None: no optimizer state (zeroth-order).
        home: tier of the authoritative copies (``Tier.NVME`` or ``Tier.HOST``).
        homes: per unit, the home tiers of (weights, state, spilled gradients); overrides ``home``.
        init_weights, master_weights, quantize_frozen, state_piece_bytes: how each unit is
            laid out, see :func:`unit_layout.store_unit`.
        update_on_device: on an accelerator, the update runs there (the state streams to it);
            False: in HOST, by the CPU (see :meth:`_tier`).
    """

    def __init__(self, store: TieredStore, units: list[Unit], optimizer: Any, home: Tier = Tier.NVME,
                 homes: list[tuple[Tier, Tier, Tier]] | None = None, init_weights: InitWeights | None = None,
                 master_weights: bool = True, quantize_frozen: bool = False,
                 state_piece_bytes: int | None = None, update_on_device: bool = True):
        self.store = store
        self.units = units
        #: where optimizer state and spilled gradients are used: the tier the update runs in
        self.state_tier = Tier.DEVICE if store.device.is_accelerator and update_on_device else Tier.HOST
        homes = homes or [(Tier.parse(home),) * 3] * len(units)
        # The arenas sit empty while the units are laid out: their pages go back to the OS
        # (faulted in again when training uses them), so the setup's peak — a large unit's
        # initial weights, fp32 masters and state (an 8B embedding's: 4 GiB) — is not paid
        # on top of them.
        for tier in (Tier.DEVICE, Tier.HOST):
            store.discard_free(tier)
        for unit in units:
            store_unit(store, unit, optimizer, homes[unit.index], init_weights=init_weights,
                       master_weights=master_weights, quantize_frozen=quantize_frozen,
                       state_piece_bytes=state_piece_bytes, state_streams=self.state_tier is Tier.DEVICE)
        self._spare: torch.Tensor | None = None  # a released unit's dequantized buffer (_decode_buffer)
        self._tick = count()  # orders kept copies for eviction, least recently released first
        self._writes: list[Future] = []  # write-backs and evictions in flight

    def _tier(self, part: Part) -> Tier:
        """Where ``part`` is used: weights where they compute (DEVICE); optimizer state and
        spilled gradients where the update runs (``state_tier``) — on an accelerator the device
        by default (the state streams to it: its memory bandwidth, not a consumer CPU's, does the
        update), or HOST RAM when the CPU updates there (``update_on_device=False``: the state's
        bytes stay off the link, the gradients and updated weights cross it); on a CPU-only
        machine the HOST RAM the CPU updates in."""
        return Tier.DEVICE if part.kind == WEIGHTS else self.state_tier

    # -- fetch, use, release ----------------------------------------------------------
    def prefetch(self, index: int, part: Part | str) -> None:
        """Start bringing ``part`` of unit ``index`` to its working tier (no wait); a no-op when it
        is already fetched or there is no room now (``acquire`` then fetches it when needed)."""
        unit, part = self.units[index], Part.of(part)
        h = _handles(unit, part).get(part)
        if h is None or h.copies[self._tier(part)].pins:
            return
        try:
            unit.memory.prefetched[part] = self._fetch(unit, part)
        except BudgetError:
            return

    def acquire(self, index: int, part: Part | str) -> torch.Tensor:
        """The resident working copy [numel] of ``part``, pinned (waits if still in flight).
        Each acquire pins once: call :meth:`release` once per acquire."""
        unit, part = self.units[index], Part.of(part)
        # the prefetch's pin (if any) is this consumer's
        fetch = unit.memory.prefetched.pop(part, None) or self._fetch(unit, part)
        flat = self.store.result(fetch)  # the consumer stalls here while the transfer runs
        nf4 = unit.layout.nf4
        if part.kind != WEIGHTS or nf4 is None:
            return flat
        if unit.memory.decoded is None:  # decoded where it computes
            unit.memory.decoded = nf4.decode(flat, self._decode_buffer(unit.numel, nf4.dtype, flat.device))
        return unit.memory.decoded

    def _decode_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Where a quantized unit is dequantized: the last released unit's buffer when nothing views
        it any more (a checkpointed block's saved tensors can outlive its release), else a new one.
        A new buffer page-faults as it is written: a 70B block's 1.7 GB in bf16, ~0.4 s of kernel
        time, twice per block and step."""
        spare, self._spare = self._spare, None
        if (spare is not None and spare.numel() >= numel and spare.dtype == dtype and spare.device == device
                and not _viewed(spare)):
            return spare[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def pins(self, index: int, part: Part | str = WEIGHTS) -> int:
        """How many consumers hold ``part`` of unit ``index`` now."""
        unit, part = self.units[index], Part.of(part)
        return _handles(unit, part)[part].copies[self._tier(part)].pins - (part in unit.memory.prefetched)

    def before_update(self, index: int, part: Part | str) -> None:
        """Return once no earlier write-back still reads this copy: it must not change under
        the disk's read."""
        unit, part = self.units[index], Part.of(part)
        self.store.wait_unread(_handles(unit, part)[part], self._tier(part))

    def release(self, index: int, part: Part | str, dirty: bool, keep: bool = False) -> None:
        """Drop one pin (``dirty``: this consumer changed the copy). At the last pin a changed
        copy is written back to its home asynchronously — not before: another consumer may
        still change it — and a copy outside its home is kept resident (``keep``: needed
        again soon) or evicted."""
        unit, part = self.units[index], Part.of(part)
        self._reap()
        h, tier = _handles(unit, part)[part], self._tier(part)
        if dirty and part.kind == WEIGHTS and unit.layout.nf4 is not None:
            raise ValueError(f"unit {unit.name} holds NF4-quantized frozen weights; they cannot be updated")
        self.store.release(h, tier)
        if dirty:
            self.store.mark_dirty(h, tier)
        if h.copies[tier].pins:
            return  # another consumer still holds it
        if part.kind == WEIGHTS and unit.layout.nf4 is not None and unit.memory.decoded is not None:
            decoded, unit.memory.decoded = unit.memory.decoded, None
            self._spare = decoded if decoded._base is None else decoded._base  # one spare at most
        if tier is h.home:
            return
        if h.dirty_tier is tier:
            fault_point("unit_write_back")
            self._writes.append(self.store.write_back(h))
        if keep:
            unit.memory.kept[part] = next(self._tick)
        else:
            self._writes.append(self.store.evict(h, tier))

    def _fetch(self, unit: Unit, part: Part) -> Future:
        h, tier = _handles(unit, part)[part], self._tier(part)
        unit.memory.kept.pop(part, None)
        while True:
            try:
                return self.store.fetch(h, tier)
            except BudgetError:
                if not self._evict_one(tier):
                    raise

    def _evict_one(self, tier: Tier) -> bool:
        """Evict the least recently released kept copy in ``tier``; False if none."""
        kept = [(tick, unit, part) for unit in self.units for part, tick in unit.memory.kept.items()
                if self._tier(part) is tier and not _handles(unit, part)[part].copies[tier].pins]
        if kept:
            _, unit, part = min(kept, key=lambda c: c[0])
            del unit.memory.kept[part]
            self.store.evict(_handles(unit, part)[part], tier).result()  # must be free before retrying
            return True
        # Evictions started on release may still be writing back: wait for them to free.
        pending = [f for f in self._writes if not f.done()]
        for f in pending:
            f.result()
        self._writes.clear()
        return bool(pending) or self._drop_prefetch(tier)

    def _drop_prefetch(self, tier: Tier) -> bool:
        """Give up the most recently started prefetch in ``tier`` that no consumer holds yet:
        a fetch needed now wins over one needed later (which ``acquire`` fetches again). Without
        it a tight window can fill with later pieces' prefetches, or fragment around them."""
        for unit in reversed(self.units):
            for part in reversed(list(unit.memory.prefetched)):
                if self._tier(part) is not tier:
                    continue
                h = _handles(unit, part)[part]
                self.store.result(unit.memory.prefetched.pop(part))  # the transfer lands, then its slot goes
                self.store.release(h, tier)
                if not h.copies[tier].pins and tier is not h.home:
                    self.store.evict(h, tier).result()
                return True
        return False

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

    @property
    def stall_s(self) -> float:
        """Seconds consumers waited for transfers (the store's one counter)."""
        return self.store.stall_s

    # -- spilled gradients (clipping / accumulation out of core) -------------------------
    def spill_grads(self, index: int, grads: dict[int, torch.Tensor], first: bool) -> torch.Tensor | None:
        """Add a unit's gradients (slot index -> grad) into its spilled gradient, on its home tier.

        The first spill of a step registers a fresh handle: its first fetch is zeros
        with no read, and it is *copied* into (not added: ``0 + -0.0`` would lose the sign
        bit the in-memory gradient keeps). Later micro-batches fetch and add, as
        autograd's accumulation does (``old + new``). Returns the pinned working copy;
        the caller reads what it needs and calls ``release(index, GRADS, dirty=True)``.
        A pieced unit spills piece by piece and returns None (see :meth:`spill_pieces`).
        """
        unit = self.units[index]
        if unit.layout.pieces:
            self.spill_pieces(index, lambda k, lo, hi: grads[k].view(-1)[lo:hi],
                              next(iter(grads.values())).dtype, first)
            return None
        if first:
            unit.memory.spilled[Part(GRADS)] = self.store.register(
                f"{unit.name}:{GRADS}", shape=(unit.numel,), dtype=_unit_dtype(unit), home=unit.layout.homes[2])
        flat = self.acquire(index, GRADS)
        for k, g in grads.items():
            view = unit.view(flat, unit.slots[k])
            # (updated on the host, the spilled gradient is in HOST and g on the device: the
            # sum is taken in HOST, the same arithmetic)
            view.copy_(g) if first else view.add_(g.to(view.device))
        return flat

    def spill_pieces(self, index: int, segment: Callable[[int, int, int], torch.Tensor], dtype: torch.dtype,
                     first: bool) -> None:
        """``spill_grads`` of a pieced unit: its gradients written a piece at a time, each piece
        the segments it covers back to back (``segment(slot, lo, hi)``: that gradient's elements,
        1-D). A later micro-batch adds each spilled segment into the gradient in place first
        (``old + new``, autograd's order), so the gradients hold the totals the caller takes
        the norms of."""
        unit = self.units[index]
        pieces = unit.layout.pieces
        for i, piece in enumerate(pieces):
            part = Part(GRADS, i)
            if first:
                unit.memory.spilled[part] = self.store.register(
                    f"{unit.name}:{part}", shape=(piece.hi - piece.lo,), dtype=dtype, home=unit.layout.homes[2])
            elif i + 1 < len(pieces):
                self.prefetch(unit.index, Part(GRADS, i + 1))
            spilled, at = self.acquire(unit.index, part), 0
            for k, lo, hi in piece.segments:
                flat = segment(k, lo, hi)
                if not first:
                    torch.add(spilled[at:at + hi - lo].to(flat.device), flat, out=flat)
                spilled[at:at + hi - lo].copy_(flat)
                at += hi - lo
            self.release(unit.index, part, dirty=True)  # written home and evicted, asynchronously

    def drop_grads(self, index: int) -> None:
        """Forget a unit's spilled gradient (its update has consumed it)."""
        unit = self.units[index]
        for part in list(unit.memory.spilled):
            unit.memory.kept.pop(part, None)
            self.store.unregister(unit.memory.spilled.pop(part))

    # -- whole buffers, for checkpoints and tests -----------------------------------------
    def weights(self, index: int) -> torch.Tensor:
        """A CPU copy of a unit's newest weights (blocks), dequantized when stored in NF4."""
        unit = self.units[index]
        raw, nf4 = self.store.load(unit.layout.handles[Part(WEIGHTS)]), unit.layout.nf4
        return raw if nf4 is None else nf4.decode(raw, torch.empty(unit.numel, dtype=nf4.dtype))

    def kinds(self, index: int) -> list[str]:
        """Every state kind of unit ``index`` (pieced or not), in ``state_spec`` order."""
        return self.units[index].layout.kinds()

    def kind_layout(self, index: int, kind: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of the flat buffer of ``kind`` (``WEIGHTS`` or a state kind) as
        :meth:`state` returns it, pieced or not."""
        numel, dtype = self.units[index].layout.flat[kind]
        return (numel,), dtype

    def state(self, index: int, kind: str) -> torch.Tensor:
        """A CPU copy of the unit's buffer ``kind`` as stored (a pieced kind's pieces joined)."""
        layout = self.units[index].layout
        parts = layout.kind_parts(kind)
        if not layout.ratios.get(kind):  # kept whole (a sharded unit's pieces cover its range only)
            return self.store.load(layout.handles[parts[0][0]])
        numel, dtype = layout.flat[kind]
        out = torch.zeros(numel, dtype=dtype)  # the padding after the last piece stays zero
        for part, lo, hi in parts:
            out[lo:hi] = self.store.load(layout.handles[part])
        return out

    def overwrite(self, index: int, kind: str, value: torch.Tensor) -> None:
        """Replace the unit's buffer ``kind`` (resume from a checkpoint): each part through a
        pinned working copy, marked dirty and written home, so every tier agrees afterwards."""
        unit = self.units[index]
        for part, lo, hi in unit.layout.kind_parts(kind):
            h, tier = unit.layout.handles[part], self._tier(part)
            view = self.store.fetch(h, tier).result()
            self.store.wait_unread(h, tier)  # a write-back still reading it (through HOST staging) lands first
            view.copy_(value.reshape(-1)[lo:hi].view(h.shape))
            self.store.mark_dirty(h, tier)
            if tier is not h.home:
                self.store.write_back(h).result()
            self.store.release(h, tier)
            if tier is not h.home:
                self.store.evict(h, tier).result()
                unit.memory.kept.pop(part, None)


def _handles(unit: Unit, part: Part) -> dict[Part, TensorHandle]:
    """Where ``part``'s handle is kept: a spilled gradient's registers each step (``Unit.memory``),
    the weights' and the state's are the unit's layout."""
    return unit.memory.spilled if part.kind == GRADS else unit.layout.handles


def _viewed(buffer: torch.Tensor) -> bool:
    """Does any tensor besides ``buffer`` use its memory? (Without torch's count of a storage's
    users, assume so: a buffer is then never reused, only reallocated.)"""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return True
    return use_count(buffer.untyped_storage()._cdata) > 2  # ``buffer`` and the wrapper asked here
