"""The optimizer side of the out-of-core step: each unit's update, in place, state streamed.

*Step-in-backward* (``OutOfCoreEngine``): as soon as every parameter of a unit has its
gradient, :meth:`UnitUpdater.update` runs — state fetched ahead, updated in place,
written back asynchronously — while autograd goes on with earlier units; the gradients
are freed at once. With global-norm clipping or gradient accumulation the updates wait
for every gradient: gradients are kept, or *spilled* to the state's home tier as each
unit's completes (:meth:`UnitUpdater.spill_grads`); once :meth:`UnitUpdater.clip` knows the
norm, the engine's ``end_step`` calls :meth:`UnitUpdater.update` unit by unit. A unit
whose state dwarfs a block's (the embedding, an untied head, an MoE block among dense ones)
updates a block-sized piece at a time (``unit_sizes.state_pieces``). All of it is exact:
fp32 and the same seed give the in-memory run's weights bit for bit. The norms of each
unit's spilled gradients, kept for the clip (``UnitStep.norms``), are written here only.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from ...optim._base import PIECE_OFFSETS
from ..device import compute_event, host_wait
from ..distributed import global_norm
from ..store import Tier
from .scratch import HostStaging, WidenedGrads
from .sharding import gather_weights, reduce_grads
from .tied_embedding import dense_range
from .unit_memory import StoreUnitMemory
from .units import GRADS, WEIGHTS, Part, Unit

HOST_DEVICE = torch.device("cpu")  # where HOST-tier tensors live


def _clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The factor ``clip_grads_with_norm_`` multiplies every gradient by (same expressions)."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, computed the way ``clip_grad_norm_`` computes it on this device."""
    from torch.utils._foreach_utils import _has_foreach_support

    if grads and _has_foreach_support(grads, grads[0].device):
        return list(torch._foreach_norm(grads, 2.0))
    return [torch.linalg.vector_norm(g, 2.0) for g in grads]


def step_in_memory(params: list[torch.nn.Parameter], optimizer: Any, max_grad_norm: float,
                   lr: float) -> torch.Tensor | None:
    """Clip ``params``' gradients by their global norm (0: no clipping), step ``optimizer`` at
    ``lr`` and free the gradients: the in-memory update, of a whole model or of resident
    adapters. Returns the norm (None without clipping)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm) if max_grad_norm > 0 else None
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


class UnitUpdater:
    """Run the optimizer's update of each unit out of core.

    Args:
        mem: the units' memory (weights bound by the engine, state fetched here).
        optimizer: an ``OutcoreOptimizer`` (``update(params, grads, states, group)``).
        prefetch_depth: units (or pieces) whose state is fetched ahead.
        max_grad_norm: global-norm clipping (0 = off).
        spill: gradients go to the state's home tier as each unit's completes.
    """

    def __init__(self, mem: StoreUnitMemory, optimizer: Any, prefetch_depth: int, max_grad_norm: float,
                 spill: bool):
        self.mem, self.optimizer = mem, optimizer
        self.group = optimizer.param_groups[0]
        self.prefetch_depth, self.max_grad_norm, self.spill = prefetch_depth, max_grad_norm, spill
        self.lr = self.group["lr"]
        self.clip_norm: torch.Tensor | None = None  # this step's global norm (spill mode)
        self.widen = WidenedGrads()  # mixed precision: the fp32 gradients, one buffer for every unit
        # weights computed on an accelerator, state updated in HOST by the CPU (update_on="host")
        self.on_host = mem.state_tier is Tier.HOST and mem.store.device.is_accelerator
        self.staging = HostStaging(mem.store.device.torch_device) if self.on_host else None
        # Updated on the host in the backward, a unit's CPU update runs on this thread while the
        # accelerator computes the backward of the units before it (``_start`` / ``finish``).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="outcore-host-update") if self.on_host else None
        self._in_flight: tuple[Unit, Callable[[], None], Future, list[torch.Tensor]] | None = None
        self._up_done: Any = None  # the last copy up of new weights: their HOST buffer is free after it

    def prefetch_state(self, unit: Unit) -> None:
        """Start fetching what the unit's update reads first: its state (the first piece of a
        pieced unit's)."""
        for kind in unit.layout.whole_kinds:
            self.mem.prefetch(unit.index, kind)
        if unit.layout.pieces:
            for part in unit.piece_parts(0):
                self.mem.prefetch(unit.index, part)

    def _step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
              states: list[dict[str, torch.Tensor]], offsets: list[int] | None = None) -> None:
        """The optimizer's update of ``params`` in place (through fp32 masters when the state has
        them); ``offsets``: where each of a piece's segments starts in its tensor."""
        group = self._group(offsets)
        with torch.no_grad():
            if self.on_host:  # blocking copies down: they wait for the backward that made the gradients
                new = self._host_update(*self._host_inputs(params, grads, states), states, group, like=params)
            elif states and "master" in states[0]:
                new = self._update_masters(grads, states, group)
            else:
                self.optimizer.update(params, grads, states, group)
                return
            for p, w in zip(params, new):
                p.copy_(w)

    def _group(self, offsets: list[int] | None) -> dict[str, Any]:
        """The optimizer's group for an update now: this step's lr, a piece's segment offsets."""
        return {**self.group, "lr": self.lr, PIECE_OFFSETS: offsets}

    def _update_masters(self, grads: list[torch.Tensor], states: list[dict[str, torch.Tensor]],
                        group: dict[str, Any]) -> list[torch.Tensor]:
        """Mixed precision: the update runs on the fp32 masters (popped from ``states``) with the
        gradients made fp32 (exact: a widening cast); returns the masters, for the caller to round
        into the 16-bit weights the next forward computes with."""
        masters = [st.pop("master") for st in states]
        self.optimizer.update(masters, self.widen(grads, masters[0].dtype), states, group)
        return masters

    # -- updated in HOST, on an accelerator ------------------------------------------------
    def _host_inputs(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[dict[str, torch.Tensor]], non_blocking: bool = False
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The gradients in HOST (spilled ones are there; others come down through pinned memory)
        and, without masters, the weights, which are their own masters (None with masters)."""
        masters = bool(states) and "master" in states[0]
        return (self._down("grads", grads, non_blocking),
                None if masters else self._down("weights", params, non_blocking))

    def _host_update(self, grads: list[torch.Tensor], weights: list[torch.Tensor] | None,
                     states: list[dict[str, torch.Tensor]], group: dict[str, Any],
                     like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The update in HOST; returns the new weights there, pinned, typed as ``like``: the weights
        updated in place, or the masters rounded to the 16-bit dtype in HOST (2 bytes per weight
        go up instead of 4; the same rounding)."""
        if weights is not None:
            self.optimizer.update(weights, grads, states, group)
            return weights
        return self._stage("weights", self._update_masters(grads, states, group), like=like)

    # -- one unit -------------------------------------------------------------------------
    def update(self, unit: Unit, then: Callable[[], None]) -> None:
        """Update ``unit`` (its weights bound: ``unit.step.bound``) in place and free its gradients.
        Its state is released dirty (written back asynchronously); ``then()`` runs once its new
        weights are in place (the caller releases them there): at once, or — updated on the host
        in the backward — at the next unit's update or :meth:`finish`, the CPU's update having
        run meanwhile beside the accelerator's backward."""
        self.finish()
        if self.on_host and not (self.spill or unit.layout.pieces or unit.shard):
            self._start(unit, then)
            return
        train = unit.train_slots
        self.mem.before_update(unit.index, WEIGHTS)
        # data parallel, in the backward: sum the ranks' gradients, keep this rank's range
        reduced = reduce_grads(unit, {k: unit.slots[k].param.grad for k in train}) if (
            unit.shard and not self.spill) else None
        if unit.layout.pieces or unit.shard:
            self._update_pieces(unit, reduced)
        else:
            self._update_whole(unit, train)
        if unit.shard:
            gather_weights(unit)  # every rank's updated range, into every rank's weights
        for k in train:
            unit.slots[k].param.grad = None  # freed now: step-in-backward never holds all gradients
        if self.spill:
            self.mem.drop_grads(unit.index)
        for kind in unit.layout.whole_kinds:
            self.mem.release(unit.index, kind, dirty=True)
        then()

    # -- one unit updated by the CPU while the accelerator computes ---------------------------
    def _start(self, unit: Unit, then: Callable[[], None]) -> None:
        """Bring the unit's gradients (and weights without masters) down and hand its update to
        the worker thread. The copies are queued on the compute stream, behind the backward that
        made the gradients: the gradients are freed at once (the allocator reuses their memory
        behind the copy) and the worker waits for the copies' event, not the caller."""
        train = unit.train_slots
        self.mem.before_update(unit.index, WEIGHTS)
        flats = {kind: self.mem.acquire(unit.index, kind) for kind in unit.layout.whole_kinds}
        states = [unit.layout.state_views(flats, k) for k in train]
        params = [unit.view(unit.step.bound, unit.slots[k]) for k in train]
        grads, weights = self._host_inputs(params, self._dense_grads(unit, train), states, non_blocking=True)
        landed = compute_event(params[0].device)
        for k in train:
            unit.slots[k].param.grad = None
        job = self._worker.submit(self._host_step, landed, params, grads, weights, states)
        self._in_flight = (unit, then, job, params)

    def _host_step(self, landed: Any, params: list[torch.Tensor], grads: list[torch.Tensor],
                   weights: list[torch.Tensor] | None, states: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The worker's part: :meth:`_host_update` once the copies down have landed. ``landed`` is
        behind the unit before's copy up on the compute stream: its HOST buffer is free once
        ``landed`` is."""
        host_wait(landed)
        with torch.no_grad():
            return self._host_update(grads, weights, states, self._group(None), like=params)

    def finish(self) -> None:
        """Complete the unit updating on the worker, if any: its new weights are copied up (queued
        on the compute stream, from pinned memory: the caller does not wait), its state released
        dirty, then its ``then()``. A failed update raises here."""
        if self._in_flight is None:
            return
        unit, then, job, params = self._in_flight
        self._in_flight = None
        new = job.result()
        with torch.no_grad():
            for p, w in zip(params, new):
                p.copy_(w, non_blocking=True)
        self._up_done = compute_event(params[0].device)
        for kind in unit.layout.whole_kinds:
            self.mem.release(unit.index, kind, dirty=True)
        then()

    def close(self) -> None:
        """Wait for an update still on the worker (its error dropped: the caller is failing or
        done) and stop the worker."""
        if self._in_flight is not None:
            self._in_flight[2].exception()
            self._in_flight = None
        if self._worker is not None:
            self._worker.shutdown()

    def _update_whole(self, unit: Unit, train: list[int]) -> None:
        flats = {kind: self.mem.acquire(unit.index, kind) for kind in unit.layout.whole_kinds}
        params = [unit.view(unit.step.bound, unit.slots[k]) for k in train]
        if self.spill:
            flat = self.mem.acquire(unit.index, GRADS)
            grads = [unit.view(flat, unit.slots[k]) for k in train]
            if self.clip_norm is not None:  # clip_grads_with_norm_'s arithmetic, on this unit's share
                coef = _clip_coef(self.max_grad_norm, self.clip_norm).to(flat.device)
                for g in grads:
                    g.mul_(coef)
        else:
            grads = self._dense_grads(unit, train)
        self._step(params, grads, [unit.layout.state_views(flats, k) for k in train])
        if self.spill:
            self.mem.release(unit.index, GRADS, dirty=False)

    @staticmethod
    def _dense_grads(unit: Unit, train: list[int]) -> list[torch.Tensor]:
        """The gradients of ``unit``'s slots ``train``, dense (a row-gradient embedding's made whole)."""
        return [dense_range(g, 0, g.numel()).view(g.shape) for g in (unit.slots[k].param.grad for k in train)]

    def _update_pieces(self, unit: Unit, reduced: torch.Tensor | None = None) -> None:
        """Update a pieced unit a piece at a time, each piece's state fetched while the one
        before is updated (see ``state_pieces``). A piece covers ranges of one or more slots
        (``Piece.segments``); a slot's whole-kept state (the step count) is set back before
        each piece that covers it, so it advances once, as for the whole. A sharded unit's
        pieces cover its range, their gradient ``reduced`` (or spilled)."""
        layout = unit.layout
        whole = {kind: self.mem.acquire(unit.index, kind) for kind in layout.whole_kinds}
        start = {kind: t.clone() for kind, t in whole.items()}  # the step counts every piece advances
        coef = None if self.clip_norm is None else _clip_coef(self.max_grad_norm, self.clip_norm)
        pieces = layout.pieces
        for i, piece in enumerate(pieces):
            for j in range(i + 1, min(len(pieces), i + 1 + self.prefetch_depth)):
                for part in unit.piece_parts(j):
                    self.mem.prefetch(unit.index, part)
            parts = {part: self.mem.acquire(unit.index, part) for part in unit.piece_parts(i)}
            spilled = parts.pop(Part(GRADS, i)) if self.spill else None
            params, grads, states, at = [], [], [], 0
            for k, lo, hi in piece.segments:
                for kind, t in whole.items():
                    s = layout.states[k][kind]
                    t[s.offset:s.offset + s.shape.numel()].copy_(start[kind][s.offset:s.offset + s.shape.numel()])
                params.append(unit.view(unit.step.bound, unit.slots[k]).view(-1)[lo:hi])
                if self.spill:
                    g = spilled[at:at + hi - lo]
                elif reduced is not None:
                    g = reduced[unit.shard.at(k, lo):unit.shard.at(k, hi)]
                else:
                    g = dense_range(unit.slots[k].param.grad, lo, hi)
                at += hi - lo
                if coef is not None:
                    g.mul_(coef.to(g.device))  # clip_grads_with_norm_'s arithmetic, on this segment
                grads.append(g)
                states.append(layout.segment_state(i, k, lo, hi, whole, parts))
            self._step(params, grads, states, offsets=[lo for _, lo, _ in piece.segments])
            if self.spill:
                self.mem.release(unit.index, Part(GRADS, i), dirty=False)
            for part in parts:
                self.mem.release(unit.index, part, dirty=True)  # written back while the next piece updates

    # -- gradients that wait for the whole backward -----------------------------------------
    def spill_grads(self, unit: Unit, first: bool, last: bool) -> None:
        """Move ``unit``'s gradients out of memory (added to what earlier micro-batches spilled,
        unless ``first``); on the ``last`` micro-batch note each one's norm for the global clip."""
        grads = {k: unit.slots[k].param.grad for k in unit.train_slots}
        if unit.shard:
            self._spill_shard(unit, grads, first, last)
            return
        flat = self.mem.spill_grads(unit.index, grads, first=first)
        # a pieced unit's spill leaves the total in the gradient itself (flat is None)
        totals = list(grads.values()) if flat is None else [unit.view(flat, unit.slots[k]) for k in grads]
        if last and self.max_grad_norm > 0:
            unit.step.norms = self._where_clipped(_norms(totals))
        if flat is not None:
            self.mem.release(unit.index, GRADS, dirty=True)  # written home and evicted, asynchronously
        for k in grads:
            unit.slots[k].param.grad = None

    def _spill_shard(self, unit: Unit, grads: dict[int, torch.Tensor], first: bool, last: bool) -> None:
        """``spill_grads`` of a sharded unit: the gradients summed over the ranks, this rank's
        range spilled (added to what earlier micro-batches spilled), the rest freed."""
        reduced = reduce_grads(unit, grads)
        shard = unit.shard
        self.mem.spill_pieces(unit.index, lambda k, lo, hi: reduced[shard.at(k, lo):shard.at(k, hi)],
                              reduced.dtype, first)
        if last and self.max_grad_norm > 0:
            unit.step.norms = self._where_clipped(_norms([reduced]))  # the range's total (the padding is zeros)
        for k in grads:
            unit.slots[k].param.grad = None

    def _stage(self, slot: str, tensors: list[torch.Tensor], like: list[torch.Tensor] | None = None,
               non_blocking: bool = False) -> list[torch.Tensor]:
        """``tensors`` copied into ``slot``'s pinned HOST views shaped and typed as ``like`` (default:
        themselves; a device tensor comes down, ``non_blocking``: queued on the compute stream; a
        HOST one is cast there, as fp32 masters to 16-bit weights)."""
        # a buffer outgrown goes once the last copy up from it is done
        views = self.staging.views(slot, tensors if like is None else like,
                                   before_growing=lambda: host_wait(self._up_done))
        for v, t in zip(views, tensors):
            v.copy_(t, non_blocking=non_blocking)
        return views

    def _down(self, slot: str, tensors: list[torch.Tensor], non_blocking: bool = False) -> list[torch.Tensor]:
        """``tensors`` in HOST: as they are if they are there already, else staged."""
        if all(t.device == HOST_DEVICE for t in tensors):
            return tensors
        return self._stage(slot, tensors, non_blocking=non_blocking)

    def _where_clipped(self, norms: list[torch.Tensor]) -> list[torch.Tensor]:
        """The norms where the spilled gradients are clipped: updated in HOST, a pieced unit's
        (taken on the device, where its totals are) come down beside the others'."""
        return [n.to(HOST_DEVICE) for n in norms] if self.on_host else norms

    def clip(self, params: list[torch.nn.Parameter], units: list[Unit]) -> torch.Tensor | None:
        """Clip by the global norm (same arithmetic as ``clip_grad_norm_``); returns the norm."""
        self.clip_norm = None
        if self.max_grad_norm <= 0:
            return None
        if not self.spill:
            return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        # the norms were taken as the gradients left memory; stacked in model order and grouped
        # by device and dtype first, as clip_grad_norm_ stacks them
        if any(unit.shard for unit in units):  # each rank has the norms of its ranges
            local = torch.linalg.vector_norm(torch.stack([n for unit in units for n in unit.step.norms]), 2.0)
            for unit in units:
                unit.step.norms = []
            self.clip_norm = global_norm(local)
            return self.clip_norm
        norms: list[torch.Tensor | None] = [None] * len(params)
        for unit in units:
            for k, norm in zip(unit.train_slots, unit.step.norms):
                norms[unit.slots[k].position] = norm
            unit.step.norms = []
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p, norm in zip(params, norms):
            groups.setdefault((p.device, p.dtype), []).append(norm)
        stacked = [n for group in groups.values() for n in group]
        self.clip_norm = torch.linalg.vector_norm(torch.stack(stacked), 2.0)
        return self.clip_norm
