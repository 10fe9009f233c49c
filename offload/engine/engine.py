"""The out-of-core training engine: a model's units streamed through the tiers.

``OutOfCoreEngine`` wraps an unmodified Hugging Face causal LM. Its weights and
optimizer state live in a :class:`StoreUnitMemory` (over the ``TieredStore``);
module hooks bring each unit in just before it computes and let it go just after,
prefetching along the static order of a step (docs/architecture.md §2):

    forward   embed, block 0 … block L-1, head       (prefetch the next k units)
    backward  head, block L-1 … block 0, embed       (prefetch the next k, and their
                                                      optimizer state)

This module binds units to the model (hooks, parameters pointed into the resident
buffers, saved tensors kept by reference) and is the one writer of where each unit stands
(``Unit.step``: bound, trainable, pending; the norms are the updater's); ``update.py`` runs
each unit's optimizer update — in the backward as soon as the unit's gradients are complete
(step-in-backward), or after it when clipping or accumulation needs every gradient.

How a saved activation that *is* a weight survives the weight leaving memory:
autograd saves, e.g., ``weight.t()`` for a matmul's backward. A
``saved_tensors_hooks`` pack hook sees every saved tensor; one that lies inside
a unit's resident weight buffer is replaced by a small reference
(unit, offset, size, stride), and the unpack hook rebuilds the view from the
unit's buffer, fetched again for the backward. No model code changes.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...events import TierStats
from ..device import supports_sparse, to_device
from ..store import Tier, TieredStore
from .tied_embedding import row_gradient_embedding
from .unit_memory import StoreUnitMemory
from .units import GRADS, WEIGHTS, Unit, causal_lm_units, place_rest
from .update import UnitUpdater, step_in_memory

_EMPTY: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-element tensor a parameter points at while its unit is not resident: on the compute
    device, so the parameter's device is the one it computes on, resident or not."""
    key = (device, dtype)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


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
            stepped after the backward; None for a forward-only engine (inference: no
            parameter requires a gradient).
        memory: factory ``(units, optimizer) -> StoreUnitMemory`` that registers the
            unit buffers (and initial contents) with the store.
        prefetch: how many units ahead to prefetch (k).
        max_grad_norm: global-norm clipping (0 = off).
        grad_accum: micro-batches per optimizer step.
        units: the model cut into units (default: ``causal_lm_units(model)``).
        spill_grads: when updates wait for every gradient (clipping, accumulation),
            write each unit's gradient to the state's home tier as soon as it is
            complete instead of keeping it in memory: a model whose gradients do not
            fit in RAM can still be clipped.
        world: data-parallel ranks whose gradients are summed (units sharded by
            ``sharding.shard_units``): each rank's loss is scaled by 1 / world.
    """

    def __init__(self, model: nn.Module, optimizer: Any,
                 memory: Callable[[list[Unit], Any], StoreUnitMemory], *, prefetch: int = 2,
                 max_grad_norm: float = 0.0, grad_accum: int = 1, units: list[Unit] | None = None,
                 spill_grads: bool = False, world: int = 1):
        self.model = model
        self.optimizer = optimizer
        self.units = units if units is not None else causal_lm_units(model)
        self.prefetch_depth = max(1, prefetch)
        self.max_grad_norm, self.world = max_grad_norm, world
        # model order, as the in-memory run sees them: clip_grad_norm_ stacks the
        # per-tensor norms in this order, and the bits of the total depend on it
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.resident = self._resident_trainables()
        # Step-in-backward needs every gradient of a unit to be final when it
        # arrives: not so when they are clipped by a global norm or accumulated.
        self.step_in_backward = max_grad_norm <= 0 and grad_accum == 1 and not self.resident
        spill = spill_grads and not self.step_in_backward and not self.resident
        self._micro, self._n_micro = 0, 1  # which micro-batch of the step is running
        self._clipped = False  # this step's gradients clipped (clip() ran)
        self.mem = memory(self.units, optimizer)
        self.device = self.store.device.torch_device  # where every unit computes
        place_rest(model, self.units, self.device)
        # optimizer state passes through the HOST window rather than living there
        self._state_streams = any(h.home is Tier.NVME for u in self.units
                                  for part, h in u.layout.handles.items() if part.kind != WEIGHTS)
        self.updater = None if optimizer is None else UnitUpdater(self.mem, optimizer, self.prefetch_depth,
                                                                  max_grad_norm, spill)
        self._frozen_in_backward: list[Unit] = []  # frozen units bound for their backward, newest last
        self._phase = "forward"
        self.last_grad_norm: torch.Tensor | None = None
        for u in self.units:
            u.step.trainable = len(u.train_slots)
            for s in u.slots:
                s.param.data = _empty(s.param.dtype, self.device)
        self._handles = []
        self._in_forward: set[int] = set()  # units whose forward began and whose last module has not returned
        self._install_hooks()
        self._restore_embedding = self._row_gradient_embedding(grad_accum)

    @property
    def spill(self) -> bool:
        """Do gradients leave memory as each unit's completes (clipping / accumulation out of core)?"""
        return self.updater is not None and self.updater.spill

    def _resident_trainables(self) -> list[nn.Parameter]:
        """Trainable parameters outside every unit (LoRA adapters): they stay resident and
        ``optimizer`` steps them as usual, after the backward; the units then hold only
        frozen weights, streamed read-only (never written back)."""
        streamed = {s.param for u in self.units for s in u.slots}
        resident = [p for p in self.params if p not in streamed]
        if resident and len(resident) != len(self.params):
            raise ValueError("some trainable parameters are streamed and some resident: lay out either all "
                             "of them (full fine-tune) or none (adapters, resident_trainable=True)")
        return resident

    def _row_gradient_embedding(self, grad_accum: int) -> Callable[[], None] | None:
        """The embedding's input-side gradient arrives as rows (tied_embedding.py), not as
        autograd's dense [V, H]: added into a tied head's gradient in place (instead of two
        more [V, H] tensors; unit 0 then waits for one more gradient), or kept as an untied
        embedding's gradient and densified a piece at a time by its update. Not with
        accumulation (autograd adds (head + rows) to the earlier micro-batches' sum, this
        would add them one by one), nor untied with clipping (the norm is the dense one's)."""
        embed = self.units[0] if self.units else None
        if (embed is None or len(embed.modules) != 1 or grad_accum != 1 or embed.step.trainable != 1
                or not supports_sparse(self.device)):
            return None
        tied = 0 in self.units[-1].borrows
        if not (tied or self.step_in_backward):
            return None
        restore = row_gradient_embedding(embed.modules[0], self._embedding_rows)
        if restore is not None and tied:
            embed.step.trainable += 1
        return restore

    # ------------------------------------------------------------------ binding
    def _bind(self, index: int) -> None:
        """Hold unit ``index`` resident (one store pin per holder) and point its parameters at it."""
        flat = self.mem.acquire(index, WEIGHTS)
        unit = self.units[index]
        if unit.step.bound is None:
            for slot in unit.slots:
                slot.param.data = unit.view(flat, slot)
            unit.step.bound = flat

    def _unbind(self, index: int, dirty: bool = False) -> None:
        """Drop one hold; at the last (or after an update, which ends every phase that held the
        unit: ``dirty``) point the parameters at an empty tensor and hand the unit back."""
        unit = self.units[index]
        holders = self.mem.pins(index)
        if dirty:
            for _ in range(holders - 1):
                self.mem.release(index, WEIGHTS, dirty=False)
        elif holders > 1:
            self.mem.release(index, WEIGHTS, dirty=False)
            return
        for slot in unit.slots:
            slot.param.data = _empty(slot.param.dtype, self.device)
        unit.step.bound = None
        self.mem.release(index, WEIGHTS, dirty=dirty, keep=self._needed_soon(index))

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

    def prefetch_first(self) -> None:
        """Start fetching the first k units, which every forward begins with (no wait)."""
        self._prefetch(range(min(len(self.units), self.prefetch_depth)))

    def _prefetch(self, indices: range) -> None:
        for j in indices:
            self.mem.prefetch(j, WEIGHTS)

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
        self._handles.append(self.model.register_forward_hook(lambda m, a, out: self._model_forward_end(out)))

    def _forward_begin(self, index: int) -> None:
        self._phase = "forward"
        self._in_forward.add(index)
        for i in self._needs(index):
            self._bind(i)
        self._prefetch(range(index + 1, min(len(self.units), index + 1 + self.prefetch_depth)))

    def _forward_end(self, index: int, output: Any, results: list[Any] | None = None) -> Any:
        """Let unit ``index`` go; its backward begins with the first gradient to reach ``results`` (default: output)."""
        self._in_forward.discard(index)
        if torch.is_grad_enabled():
            if results is None:
                results = [output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)]
            begun: list[bool] = []  # (a gradient may reach several results: one backward begins)
            def begin(_: torch.Tensor) -> None:
                if not begun:
                    begun.append(True)
                    self._backward_begin(index)
            for t in results:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(begin)
        for i in self._needs(index):
            self._unbind(i)
        return output

    def _model_forward_end(self, output: Any) -> None:
        """The model returned with a unit still open: a fused head read its weights without calling
        its last module (TRL's log-probabilities read ``lm_head.weight``). It ends with the model."""
        results = output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else [output]
        for index in sorted(self._in_forward):
            self._forward_end(index, output, list(results))

    def _backward_begin(self, index: int) -> None:
        """Gradient w.r.t. unit ``index``'s output exists: its backward starts now."""
        self._phase = "backward"
        # Units after this one whose weights are frozen have no gradient to say their
        # backward is over; this unit's output gradient is complete, so theirs is.
        self._release_frozen(after=index)
        for i in self._needs(index):
            self._bind(i)
        unit = self.units[index]
        step = unit.step
        if step.pending is None:  # (a tied embedding's head gradient may have counted already)
            step.pending = step.trainable
        if step.pending == 0:
            step.pending = None
            self._frozen_in_backward.append(unit)
        self._prefetch(range(index - 1, max(-1, index - 1 - self.prefetch_depth), -1))
        if self.step_in_backward:
            for j in range(index, max(-1, index - self.prefetch_depth), -1):
                self.updater.prefetch_state(self.units[j])

    def _grad_ready(self, index: int) -> None:
        """One more parameter of unit ``index`` has its gradient; the last one ends its backward."""
        unit = self.units[index]
        step = unit.step
        step.pending = (step.trainable if step.pending is None else step.pending) - 1
        if step.pending > 0:
            return
        step.pending = None
        for i in unit.borrows:
            self._unbind(i)  # a borrowed (tied) weight was needed for this unit's backward only
        if self.step_in_backward:
            self._bind(index)  # (bound by its backward already: this hold ends with the update)
            self.updater.update(unit, then=lambda: self._unbind(index, dirty=True))
            return
        if self.spill:
            self.updater.spill_grads(unit, first=self._micro == 0, last=self._micro == self._n_micro - 1)
        self._unbind(index)

    def _embedding_rows(self, rows: torch.Tensor) -> None:
        """The input side's gradient of the embedding (sparse rows): added in place into what
        a tied head gave, as autograd's merge would (same bits), or kept sparse as the whole
        gradient (``tied_embedding.dense_range`` densifies it for the update); then unit 0
        counts it."""
        (k,) = self.units[0].train_slots
        param = self.units[0].slots[k].param
        if param.grad is None:
            param.grad = rows
        else:
            param.grad.add_(rows)
        self._grad_ready(0)

    def _release_frozen(self, after: int = -1) -> None:
        """Let go of frozen units (and what they borrow) held for a backward that is over."""
        while self._frozen_in_backward and self._frozen_in_backward[-1].index > after:
            unit = self._frozen_in_backward.pop()
            for i in self._needs(unit.index):
                self._unbind(i)

    # ---------------------------------------------------------------- the step
    def _pack(self, t: torch.Tensor) -> Any:
        ptr = t.data_ptr()
        for unit in self.units:
            flat = unit.step.bound
            if flat is None:
                continue
            start = flat.data_ptr()
            if start <= ptr < start + flat.numel() * flat.element_size():
                if t.dtype != flat.dtype:  # a reinterpreting view: keep a private copy
                    return t.clone()
                return _ParamRef(unit.index, (ptr - start) // flat.element_size(),
                                 tuple(t.shape), tuple(t.stride()))
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _ParamRef):
            return packed
        unit = self.units[packed.unit]
        if unit.step.bound is None:  # not bound by a backward hook (unusual graph): fetch it now
            self._bind(packed.unit)
        flat = unit.step.bound
        return flat.as_strided(packed.size, packed.stride, flat.storage_offset() + packed.offset)

    def train_step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], micro_batches: list[Any],
                   lr: float) -> torch.Tensor:
        """One optimizer step over ``micro_batches``.

        Args:
            loss_fn: ``(model, batch) -> mean loss`` (a scalar tensor).
            micro_batches: ``grad_accum`` batches.
            lr: this step's learning rate.

        Returns:
            The summed (accumulation-scaled) loss, still a tensor on the compute device: no
            host sync here.
        """
        self.begin_step(lr, len(micro_batches))
        total = None
        for batch in micro_batches:
            with self.micro_batch():
                loss = loss_fn(self.model, to_device(batch, self.device)) / len(micro_batches)
                # ranks sum their gradients: each backs 1 / (world x micro-batches) of its loss
                (loss / self.world if self.world > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        self.end_step()
        return total

    # A caller that runs its own loop (a transformers Trainer: integrations/trainer.py) calls
    # the three parts of train_step itself: begin_step, micro_batch per forward + backward,
    # end_step (clip first, with clip(), to read the norm before the update).
    def begin_step(self, lr: float, n_micro: int) -> None:
        """Start an optimizer step of ``n_micro`` micro-batches at learning rate ``lr``."""
        self.updater.lr = lr
        if self._state_streams:
            # The HOST window holds optimizer state only while units update (the backward);
            # through the forward and the loss — the step's RSS peak — its pages are idle:
            # return them (~1% of a step to fault them back on a CPU-only machine).
            self.store.discard_free(Tier.HOST)
        self.prefetch_first()
        self._micro, self._n_micro = 0, n_micro
        self._clipped = False

    @contextmanager
    def micro_batch(self) -> Iterator[None]:
        """Run one micro-batch's forward and backward inside (saved weights kept by reference)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        if self.updater is not None:
            self.updater.finish()  # the backward's last update, if the CPU is still on it
        self._release_frozen()  # the first units' backward has no later one to end it
        self._micro += 1

    def clip(self) -> torch.Tensor | None:
        """Clip the step's gradients by their global norm (``end_step`` does it if not done);
        returns the norm (None without clipping, or when updates ran in the backward)."""
        if not self.resident and not self.step_in_backward and not self._clipped:
            self.last_grad_norm = self.updater.clip(self.params, self.units)
            self._clipped = True
        return self.last_grad_norm

    def end_step(self) -> None:
        """Finish the step: the updates that wait for the whole backward (clipping, accumulation,
        resident adapters); with step-in-backward they are done already."""
        if self.resident:  # adapters: clipped and stepped the usual way
            self.last_grad_norm = step_in_memory(self.params, self.optimizer, self.max_grad_norm, self.updater.lr)
        elif not self.step_in_backward:
            self.clip()
            self._update_units()

    def _update_units(self) -> None:
        """Update every unit after the backward (gradients clipped), its weights and state prefetched."""
        trainable = [u for u in self.units if u.step.trainable]
        for at, unit in enumerate(trainable):
            for ahead in trainable[at:at + self.prefetch_depth]:
                self.mem.prefetch(ahead.index, WEIGHTS)
                self.updater.prefetch_state(ahead)
                if self.spill:
                    self.mem.prefetch(ahead.index, GRADS)
            self._bind(unit.index)
            self.updater.update(unit, then=lambda i=unit.index: self._unbind(i, dirty=True))
        self.updater.finish()

    # ------------------------------------------------------------- the run's view
    @property
    def store(self) -> TieredStore:
        """The tiered store the units live in."""
        return self.mem.store

    def tier_stats(self) -> dict[str, TierStats]:
        """Per-tier occupancy and traffic, bandwidth over the time since the previous call."""
        return self.store.tier_stats(window=True)

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for a transfer, since the start."""
        return self.store.stall_s

    def remove(self) -> None:
        """Take the hooks off (the model's parameters stay pointed at empty tensors)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._restore_embedding is not None:
            self._restore_embedding()

    def close(self) -> None:
        """Finish every write, take the hooks off, free the arenas and remove the swap directory."""
        try:
            if self.updater is not None:
                self.updater.close()  # (before the arenas it updates in go)
            self.mem.flush()
        finally:
            self.remove()
            self.store.close()
