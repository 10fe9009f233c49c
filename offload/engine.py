"""The out-of-core training engine: a model's units streamed through the tiers.

``OutOfCoreEngine`` wraps an unmodified Hugging Face causal LM. Its weights
and optimizer state live in a :class:`UnitMemory` (over the ``TieredStore``);
module hooks bring each unit in just before it computes and let it go just
after, prefetching along the static order of a step (ARCHITECTURE.md §3–§4):

    forward   embed, block 0 … block L-1, head       (prefetch the next k units)
    backward  head, block L-1 … block 0, embed       (prefetch the next k, and their
                                                      optimizer state)

*Step-in-backward*: as soon as every parameter of a unit has its gradient
(``register_post_accumulate_grad_hook``), the unit's optimizer update runs —
state fetched ahead, updated in place, written back asynchronously — while
autograd goes on with earlier units; the gradients are freed at once. With
global-norm clipping or gradient accumulation the updates must wait for every
gradient, so gradients are kept (``spill``) and the updates run after the norm
is known, unit by unit, still prefetched. Both are exact: with fp32 and the
same seed the weights equal those of the in-memory run bit for bit.

How a saved activation that *is* a weight survives the weight leaving memory:
autograd saves, e.g., ``weight.t()`` for a matmul's backward. A
``saved_tensors_hooks`` pack hook sees every saved tensor; one that lies inside
a unit's resident weight buffer is replaced by a small reference
(unit, offset, size, stride), and the unpack hook rebuilds the view from the
unit's buffer, fetched again for the backward. No model code changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .tied_embedding import row_gradient_embedding
from .unit_sizes import GRADS
from .units import Unit, causal_lm_units

_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def _empty(dtype: torch.dtype) -> torch.Tensor:
    """A 0-element tensor a parameter points at while its unit is not resident."""
    if dtype not in _EMPTY:
        _EMPTY[dtype] = torch.empty(0, dtype=dtype)
    return _EMPTY[dtype]


def _clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The factor ``clip_grads_with_norm_`` multiplies every gradient by (same expressions)."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, computed the way ``clip_grad_norm_`` computes it on this device."""
    from torch.utils._foreach_utils import _has_foreach_support

    if grads and _has_foreach_support(grads, grads[0].device):
        return list(torch._foreach_norm(grads, 2.0))
    return [torch.linalg.vector_norm(g, 2.0) for g in grads]


class UnitMemory(Protocol):
    """Where the engine's flat unit buffers live (implemented over the TieredStore).

    ``kind`` is ``"w"`` (weights) or an optimizer-state name (``"exp_avg"`` …);
    ``unit_kinds[i]`` lists the state names unit ``i`` fetches whole. A unit in
    ``pieces`` (its one trainable parameter's element ranges) has the rest of its state
    in pieces, kinds ``piece_kinds(i, piece)``, assembled by ``piece_state``.
    """

    unit_kinds: list[list[str]]
    pieces: dict[int, list[tuple[int, int]]]

    def piece_kinds(self, unit: int, piece: int) -> list[str]:
        """The state kinds of one piece of a pieced unit."""

    def piece_state(self, unit: int, k: int, piece: int, whole: dict[str, torch.Tensor],
                    part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The optimizer's state dict for one piece of slot ``k``."""

    def prefetch(self, unit: int, kind: str) -> None:
        """Start bringing ``kind`` of ``unit`` to the working tier (no wait)."""

    def acquire(self, unit: int, kind: str) -> torch.Tensor:
        """The resident working copy [numel] (waits if still in flight; pins it)."""

    def release(self, unit: int, kind: str, dirty: bool, keep: bool = False) -> None:
        """Unpin; a dirty copy is written back to its home tier asynchronously.
        ``keep``: the unit is needed again soon, leave it resident while there is room."""

    def before_update(self, unit: int, kind: str) -> None:
        """Return once no earlier write-back still reads this copy."""


@dataclass(frozen=True)
class _ParamRef:
    """A saved tensor that is a view of a unit's weights, stored by reference."""

    unit: int
    offset: int  # element offset from the start of the unit's flat buffer
    size: tuple[int, ...]
    stride: tuple[int, ...]


class OutOfCoreEngine:
    """Train an unmodified causal LM whose weights and optimizer state do not stay in memory.

    Args:
        model: the model; its parameters are laid out into unit buffers and
            their own storage is released (they point at the unit buffers while
            resident, at an empty tensor otherwise).
        optimizer: an ``outcore.optim.OutcoreOptimizer`` (``state_spec`` /
            ``update``) built over ``model``'s trainable parameters; when those stay
            resident (no unit lays them out: LoRA adapters), any torch optimizer,
            stepped after the backward.
        memory: factory ``(units, optimizer) -> UnitMemory`` that registers the
            unit buffers (and initial contents) with the store.
        prefetch: how many units ahead to prefetch (k).
        max_grad_norm: global-norm clipping (0 = off).
        grad_accum: micro-batches per optimizer step.
        units: the model cut into units (default: ``causal_lm_units(model)``).
        spill_grads: when updates wait for every gradient (clipping, accumulation),
            write each unit's gradient to the state's home tier as soon as it is
            complete instead of keeping it in memory (``UnitMemory.spill_grads``):
            a model whose gradients do not fit in RAM can still be clipped.
    """

    def __init__(self, model: nn.Module, optimizer: Any,
                 memory: Callable[[list[Unit], Any], UnitMemory], *, prefetch: int = 2,
                 max_grad_norm: float = 0.0, grad_accum: int = 1, units: list[Unit] | None = None,
                 spill_grads: bool = False):
        self.model = model
        self.optimizer = optimizer
        self.group = optimizer.param_groups[0]
        self.units = units if units is not None else causal_lm_units(model)
        self.prefetch_depth = max(1, prefetch)
        self.max_grad_norm = max_grad_norm
        self.grad_accum = grad_accum
        # model order, as the in-memory run sees them: clip_grad_norm_ stacks the
        # per-tensor norms in this order, and the bits of the total depend on it
        self.params = [p for p in model.parameters() if p.requires_grad]
        streamed = {id(s.param) for u in self.units for s in u.slots}
        # Trainable parameters outside every unit (LoRA adapters) stay resident and
        # are stepped by `optimizer` as usual, after the backward; the units then
        # hold only frozen weights, streamed read-only (never written back).
        self.resident = [p for p in self.params if id(p) not in streamed]
        if self.resident and len(self.resident) != len(self.params):
            raise ValueError("some trainable parameters are streamed and some resident: lay out either all "
                             "of them (full fine-tune) or none (adapters, resident_trainable=True)")
        self._trainable_slots = [sum(s.param.requires_grad for s in u.slots) for u in self.units]
        # Step-in-backward needs every gradient of a unit to be final when it
        # arrives: not so when they are clipped by a global norm or accumulated.
        self.step_in_backward = max_grad_norm <= 0 and grad_accum == 1 and not self.resident
        self.spill = spill_grads and not self.step_in_backward and not self.resident
        self._micro, self._n_micro = 0, 1  # which micro-batch of the step is running
        self._norms: dict[int, torch.Tensor] = {}  # id(param) -> norm of its spilled gradient
        self._clip_norm: torch.Tensor | None = None  # this step's global norm (spill mode)
        self.mem = memory(self.units, optimizer)
        self._bound: dict[int, torch.Tensor] = {}  # unit -> resident flat weights bound to params
        self._pins: dict[int, int] = {}  # unit -> how many phases hold its weights
        self._pending: dict[int, int] = {}  # unit -> params still waiting for their gradient
        self._frozen_in_backward: list[int] = []  # frozen units bound for their backward, newest last
        self._lr = self.group["lr"]
        self._phase = "forward"
        for u in self.units:
            for s in u.slots:
                s.param.data = _empty(s.param.dtype)
        self._handles = []
        self._install_hooks()
        # A tied embedding: the input side's gradient arrives as rows, added into the head's
        # gradient in place (tied_embedding.py) instead of autograd's two extra [V, H]
        # tensors. Unit 0 then waits for one more gradient. Not with accumulation: autograd
        # adds (head + rows) to the earlier micro-batches' sum, this would add them one by one.
        self._restore_embedding = None
        if (self.units and 0 in self.units[-1].borrows and len(self.units[0].modules) == 1
                and grad_accum == 1 and self._trainable_slots[0] == 1):
            self._restore_embedding = row_gradient_embedding(self.units[0].modules[0], self._embedding_rows)
            if self._restore_embedding is not None:
                self._trainable_slots[0] += 1

    # ------------------------------------------------------------------ binding
    def _bind(self, index: int) -> None:
        """Make unit ``index`` resident and point its parameters at it (pinned)."""
        self._pins[index] = self._pins.get(index, 0) + 1
        if index in self._bound:
            return
        flat = self.mem.acquire(index, "w")
        unit = self.units[index]
        for slot in unit.slots:
            slot.param.data = unit.view(flat, slot)
        self._bound[index] = flat

    def _unbind(self, index: int, dirty: bool = False) -> None:
        """Drop one pin; at zero (or after an update, which ends every phase that held the
        unit) point the parameters at an empty tensor and hand the unit back to memory."""
        self._pins[index] -= 1
        if self._pins[index] > 0 and not dirty:
            return
        self._pins[index] = 0
        for slot in self.units[index].slots:
            slot.param.data = _empty(slot.param.dtype)
        del self._bound[index]
        self.mem.release(index, "w", dirty=dirty, keep=self._needed_soon(index))

    def _needed_soon(self, index: int) -> bool:
        """Will unit ``index`` be used again within the prefetch window (so keep it resident)?

        Forward ends with the last units, which backward starts with; backward ends
        with the first units, which the next step's forward starts with; a tied
        embedding is used by the head at the turn of the step.
        """
        k, n = self.prefetch_depth, len(self.units)
        if index in self.units[-1].borrows:
            return True
        if self._phase == "forward":
            return index >= n - 1 - k
        return index <= k

    def _needs(self, index: int) -> list[int]:
        return [index, *self.units[index].borrows]

    # -------------------------------------------------------------------- hooks
    def _install_hooks(self) -> None:
        for unit in self.units:
            first, last = unit.modules[0], unit.modules[-1]
            self._handles.append(first.register_forward_pre_hook(
                lambda m, a, i=unit.index: self._forward_begin(i)))
            self._handles.append(last.register_forward_hook(
                lambda m, a, out, i=unit.index: self._forward_end(i, out)))
            for slot in unit.slots:
                if slot.param.requires_grad:
                    self._handles.append(slot.param.register_post_accumulate_grad_hook(
                        lambda p, i=unit.index: self._grad_ready(i)))

    def _forward_begin(self, index: int) -> None:
        self._phase = "forward"
        for i in self._needs(index):
            self._bind(i)
        order = len(self.units)
        for j in range(index + 1, min(order, index + 1 + self.prefetch_depth)):
            self.mem.prefetch(j, "w")

    def _forward_end(self, index: int, output: Any) -> Any:
        if torch.is_grad_enabled():
            out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g, i=index: self._backward_begin(i))
        for i in self._needs(index):
            self._unbind(i)
        return output

    def _backward_begin(self, index: int) -> None:
        """Gradient w.r.t. unit ``index``'s output exists: its backward starts now."""
        self._phase = "backward"
        # Units after this one whose weights are frozen have no gradient to say their
        # backward is over; this unit's output gradient is complete, so theirs is.
        self._release_frozen(after=index)
        for i in self._needs(index):
            self._bind(i)
        # (a tied embedding's head gradient may have counted already: setdefault)
        if self._pending.setdefault(index, self._trainable_slots[index]) == 0:
            del self._pending[index]
            self._frozen_in_backward.append(index)
        for j in range(index - 1, max(-1, index - 1 - self.prefetch_depth), -1):
            self.mem.prefetch(j, "w")
        if self.step_in_backward:
            for j in range(index, max(-1, index - self.prefetch_depth), -1):
                self._prefetch_state(j)

    def _grad_ready(self, index: int) -> None:
        """One more parameter of unit ``index`` has its gradient; the last one ends its backward."""
        left = self._pending.get(index, self._trainable_slots[index]) - 1
        if left > 0:
            self._pending[index] = left
            return
        self._pending.pop(index, None)
        for i in self.units[index].borrows:
            self._unbind(i)  # a borrowed (tied) weight was needed for this unit's backward only
        if self.step_in_backward:
            self._update(index)  # releases the unit, dirty
            return
        if self.spill:
            self._spill(index)
        self._unbind(index)

    def _embedding_rows(self, rows: torch.Tensor) -> None:
        """The input side's gradient of a tied embedding (sparse rows): added in place into
        what the head gave, as autograd's merge would (same bits), then unit 0 counts it."""
        (param,) = [s.param for s in self.units[0].slots if s.param.requires_grad]
        if param.grad is None:
            param.grad = rows.to_dense()
        else:
            param.grad.add_(rows)
        self._grad_ready(0)

    def _spill(self, index: int) -> None:
        """Move unit ``index``'s gradients out of memory (added to what earlier micro-batches
        spilled); on the last micro-batch note each one's norm for the global clip."""
        unit = self.units[index]
        grads = {k: s.param.grad for k, s in enumerate(unit.slots) if s.param.requires_grad}
        flat = self.mem.spill_grads(index, grads, first=self._micro == 0)
        # a pieced unit's spill leaves the total in the gradient itself (flat is None)
        totals = list(grads.values()) if flat is None else [unit.view(flat, unit.slots[k]) for k in grads]
        if self._micro == self._n_micro - 1 and self.max_grad_norm > 0:
            for k, norm in zip(grads, _norms(totals)):
                self._norms[id(unit.slots[k].param)] = norm
        if flat is not None:
            self.mem.release(index, GRADS, dirty=True)  # written home and evicted, asynchronously
        for k in grads:
            unit.slots[k].param.grad = None

    def _release_frozen(self, after: int = -1) -> None:
        """Let go of frozen units (and what they borrow) held for a backward that is over."""
        while self._frozen_in_backward and self._frozen_in_backward[-1] > after:
            index = self._frozen_in_backward.pop()
            for i in self._needs(index):
                self._unbind(i)

    # ----------------------------------------------------------- optimizer side
    def _state_kinds(self, index: int) -> list[str]:
        """The optimizer-state tensor classes unit ``index`` has (a norm-only unit may lack some)."""
        return self.mem.unit_kinds[index]

    def _prefetch_state(self, index: int) -> None:
        """Start fetching what unit ``index``'s update reads first: its state (the first piece of
        a pieced unit's)."""
        for kind in self._state_kinds(index):
            self.mem.prefetch(index, kind)
        if index in self.mem.pieces:
            for kind in self.mem.piece_kinds(index, 0):
                self.mem.prefetch(index, kind)

    def _step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
              states: list[dict[str, torch.Tensor]]) -> None:
        """The optimizer's update of ``params`` in place (through fp32 masters when the state has them)."""
        group = {**self.group, "lr": self._lr}
        with torch.no_grad():
            if states and "master" in states[0]:
                # Mixed precision: the update runs on the fp32 master with the gradient
                # made fp32 (exact: a widening cast), then the master is rounded into
                # the 16-bit weights the next forward computes with.
                masters = [st.pop("master") for st in states]
                self.optimizer.update(masters, [g.to(m.dtype) for g, m in zip(grads, masters)], states, group)
                for p, m in zip(params, masters):
                    p.copy_(m)
            else:
                self.optimizer.update(params, grads, states, group)

    def _update_pieces(self, index: int, k: int) -> None:
        """Update the one trainable parameter (slot ``k``) of a pieced unit a piece at a time,
        each piece's state fetched while the one before is updated (see ``state_pieces``)."""
        unit, pieces = self.units[index], self.mem.pieces[index]
        whole = {kind: self.mem.acquire(index, kind) for kind in self._state_kinds(index)}
        start = {kind: t.clone() for kind, t in whole.items()}  # the step count every piece advances
        param = unit.view(self._bound[index], unit.slots[k]).view(-1)
        grad = None if self.spill else unit.slots[k].param.grad.reshape(-1)
        coef = None if self._clip_norm is None else _clip_coef(self.max_grad_norm, self._clip_norm)
        for i, (a, b) in enumerate(pieces):
            for j in range(i + 1, min(len(pieces), i + 1 + self.prefetch_depth)):
                for kind in self.mem.piece_kinds(index, j):
                    self.mem.prefetch(index, kind)
            part = {kind: self.mem.acquire(index, kind) for kind in self.mem.piece_kinds(index, i)}
            for kind, t in whole.items():
                t.copy_(start[kind])
            g = part.pop(f"{GRADS}@{i}") if self.spill else grad[a:b]
            if coef is not None:
                g.mul_(coef)  # clip_grads_with_norm_'s arithmetic, on this piece
            self._step([param[a:b]], [g], [self.mem.piece_state(index, k, i, whole, part)])
            if self.spill:
                self.mem.release(index, f"{GRADS}@{i}", dirty=False)
            for kind in part:
                self.mem.release(index, kind, dirty=True)  # written back while the next piece updates

    def _update(self, index: int) -> None:
        """Run the optimizer update of one unit, in place, and let it go dirty."""
        unit = self.units[index]
        train = [k for k, s in enumerate(unit.slots) if s.param.requires_grad]
        if not train:
            return
        self._bind(index)
        if index in self.mem.pieces:
            self.mem.before_update(index, "w")
            self._update_pieces(index, train[0])
            unit.slots[train[0]].param.grad = None
            if self.spill:
                self.mem.drop_grads(index)
            for kind in self._state_kinds(index):
                self.mem.release(index, kind, dirty=True)
            self._unbind(index, dirty=True)
            return
        flats = {kind: self.mem.acquire(index, kind) for kind in self._state_kinds(index)}
        self.mem.before_update(index, "w")
        w = self._bound[index]
        params = [unit.view(w, unit.slots[k]) for k in train]
        if self.spill:
            flat = self.mem.acquire(index, GRADS)
            for k in train:
                unit.slots[k].param.grad = unit.view(flat, unit.slots[k])
            if self._clip_norm is not None:  # torch's own clip arithmetic, on this unit's share
                torch.nn.utils.clip_grads_with_norm_([unit.slots[k].param for k in train],
                                                     self.max_grad_norm, self._clip_norm)
        grads = [unit.slots[k].param.grad for k in train]
        self._step(params, grads, [self.mem.state_views(index, flats, k) for k in train])
        for k in train:
            unit.slots[k].param.grad = None  # freed now: step-in-backward never holds all gradients
        if self.spill:
            self.mem.release(index, GRADS, dirty=False)
            self.mem.drop_grads(index)
        for kind in self._state_kinds(index):
            self.mem.release(index, kind, dirty=True)
        self._unbind(index, dirty=True)

    # ---------------------------------------------------------------- the step
    def _saved_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._bound:
            return t
        ptr = t.data_ptr()
        for index, flat in self._bound.items():
            start = flat.data_ptr()
            if start <= ptr < start + flat.numel() * flat.element_size():
                if t.dtype != flat.dtype:  # a reinterpreting view: keep a private copy
                    return t.clone()
                return _ParamRef(index, (ptr - start) // flat.element_size(),
                                 tuple(t.shape), tuple(t.stride()))
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _ParamRef):
            return packed
        flat = self._bound.get(packed.unit)
        if flat is None:  # not bound by a backward hook (unusual graph): fetch it now
            self._bind(packed.unit)
            flat = self._bound[packed.unit]
        return flat.as_strided(packed.size, packed.stride, flat.storage_offset() + packed.offset)

    def train_step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], micro_batches: list[Any],
                   lr: float) -> torch.Tensor:
        """One optimizer step over ``micro_batches``.

        Args:
            loss_fn: ``(model, batch) -> mean loss`` (a scalar tensor).
            micro_batches: ``grad_accum`` batches.
            lr: this step's learning rate.

        Returns:
            The summed (accumulation-scaled) loss, still a tensor: no host sync here.
        """
        self._lr = lr
        for j in range(min(len(self.units), self.prefetch_depth)):
            self.mem.prefetch(j, "w")
        total = torch.zeros(())
        self._n_micro, self._norms = len(micro_batches), {}
        for self._micro, batch in enumerate(micro_batches):
            with self._saved_hooks():
                loss = loss_fn(self.model, batch) / len(micro_batches)
                loss.backward()
            self._release_frozen()  # the first units' backward has no later one to end it
            total += loss.detach()
        if self.resident:
            self._step_resident()
        elif not self.step_in_backward:
            self._update_after_backward()
        return total

    def _step_resident(self) -> None:
        """Clip and step the resident trainable parameters (adapters) the usual way."""
        norm = None
        if self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_grad_norm = norm

    def _update_after_backward(self) -> torch.Tensor | None:
        """Clip by the global norm (same arithmetic as ``clip_grad_norm_``), then update every unit."""
        norm = self._clip_norm = None
        if self.max_grad_norm > 0 and self.spill:
            # the norms were taken as the gradients left memory; stacked in model order,
            # as clip_grad_norm_ stacks them
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in self.params:  # clip_grad_norm_ groups by device and dtype first
                groups.setdefault((p.device, p.dtype), []).append(self._norms[id(p)])
            norms = [n for group in groups.values() for n in group]
            norm = self._clip_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        elif self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        trainable = [i for i, n in enumerate(self._trainable_slots) if n]
        for at, index in enumerate(trainable):
            for j in trainable[at:at + self.prefetch_depth]:
                self.mem.prefetch(j, "w")
                self._prefetch_state(j)
                if self.spill:
                    self.mem.prefetch(j, GRADS)
            self._update(index)
        self.last_grad_norm = norm
        return norm

    def remove(self) -> None:
        """Take the hooks off (the model's parameters stay pointed at empty tensors)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._restore_embedding is not None:
            self._restore_embedding()
