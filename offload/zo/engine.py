"""The ZO block schedule (ZO2's dual forward), in memory or streamed from NVMe.

Each step visits every block once, in order. At block ``b``:

1. ``clean = weights.acquire(b)`` — the block's authoritative weights (the model's
   own tensors, or read from NVMe through the store's unit memory ahead of time,
   while earlier blocks computed; see :mod:`outcore.offload.zo.weights`);
2. the *previous* step's update is applied to ``clean`` in place (lazy update:
   its projected gradients were only known after the previous step's last
   block), then ``weights.release`` writes the block back asynchronously;
3. for each perturbation sample: the block's trainable parameters are pointed at
   a scratch buffer holding ``clean + eps z`` to advance that sample's "+"
   hidden state, then at ``clean - eps z`` for its "-" hidden state.
   ``clean`` itself is never perturbed, so it is restored *exactly* (no fp32
   drift from ``+eps, -2 eps, +eps``) and the z of one block is regenerated
   from ``(seed, parameter index)``, never stored.

After the head block the losses give the projected gradients; the step's
(seed, scalar) record goes to the run log. :meth:`ZOBlockTrainer.flush` applies
the last pending update. The ZO math itself (z, masks, the update, the record)
comes from the rule the hyper-parameters give (``hyper.rule(n)``, see
:class:`outcore.optim.zo_core.ZORule`). With the same seeds, in memory, from NVMe
and :func:`outcore.optim.zo_replay.replay` (schedule ``"exact"``) give
bit-identical weights. Distributed ZO plugs in through ``exchange``
(:mod:`outcore.offload.zo.distributed`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...errors import ConfigError
from ...kernels.zo_perturb import noise_backend, resolve_backend
from ..device import to_device
from ..engine import ParamSlot
from .model import CausalLMBlocks, trainable_parameters
from .weights import HostWeights, StoreWeights

SCHEDULE_EXACT = "exact"

# exchange(step, seeds, plus, minus, mine) -> (plus, minus) for all samples; see distributed.py
Exchange = Callable[[int, list[int], list[float], list[float], list[int]], tuple[list[float], list[float]]]


@dataclass
class StepStats:
    """What one ZO step cost (for StepEvent)."""

    step_s: float
    stall_s: float  # time waiting on the disk


class ZOBlockTrainer:
    """MeZO / Sparse MeZO over a causal LM, one block at a time.

    Args:
        model: a Hugging Face decoder-only causal LM (fp32 for bit-exact claims).
        hyper: ZO hyper-parameters (:class:`outcore.optim.zo_core.ZOHyper`); the
            schedule applies the rule ``hyper.rule(n_params)`` gives.
        seed: run seed (step ``t``'s samples use ``rule.seeds(seed, t)``).
        swap_dir: None keeps the weights in RAM; a directory streams them from NVMe
            through a TieredStore there (removed on close), leaving the model's
            parameters empty between visits.
        prefetch: blocks read ahead when streaming.
        rank, world: this process's share of the samples (sample ``i`` runs on
            rank ``i % world``); ``exchange`` must then combine the losses.
        exchange: combines per-rank losses into all samples' losses.
        split: ``"samples"`` (rank r evaluates samples i with i % world == r on the same
            batch) or ``"data"`` (every rank evaluates every sample on its own batch and
            the losses are averaged over ranks).
        init_weights: with ``swap_dir``, fills a parameter ``(slot, view)`` of a model
            built on the ``meta`` device as its unit goes to disk (see StoreWeights).
        device: where the blocks compute (default: the model's parameters' device). In
            memory the model must already be there; streamed, the units come to it.

    Raises:
        ConfigError: ``world`` / ``rank`` / ``split`` inconsistent, ``exchange`` missing
            with world > 1, or nothing trainable.
        SwapDirError: ``swap_dir`` cannot be used.
    """

    def __init__(self, model: torch.nn.Module, hyper: Any, seed: int = 0, swap_dir: str | None = None,
                 prefetch: int = 2, rank: int = 0, world: int = 1, exchange: Exchange | None = None,
                 split: str = "samples",
                 init_weights: Callable[[ParamSlot, torch.Tensor], None] | None = None,
                 device: torch.device | None = None) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"rank={rank}, world={world}: need world >= 1 and 0 <= rank < world")
        if world > 1 and exchange is None:
            raise ConfigError(f"world={world} needs an exchange function (see outcore.offload.zo.distributed)")
        if split not in ("samples", "data"):
            raise ConfigError(f"split={split!r} must be 'samples' or 'data'")
        self.split, self.seed = split, int(seed)
        self.rank, self.world, self.exchange = rank, world, exchange
        self.blocks = CausalLMBlocks(model)
        self.device = device or self.blocks.device
        self.names = self.blocks.names
        self.rule = hyper.rule(len(self.names))
        self.rule.state.backend = noise_backend(self.device)  # a resume sets its log's (set_backend)
        self.shapes = [(list(p.shape), str(p.dtype).replace("torch.", "")) for _, p in trainable_parameters(model)]
        self._first = [len(self.blocks)] * len(self.names)  # block where each parameter is updated (its first visit)
        for b in reversed(range(len(self.blocks))):
            for q in self.blocks.trainable(b):
                self._first[q.index] = b
        per_block = [self.blocks.trainable(b) for b in range(len(self.blocks))]
        dtypes = {q.param.dtype for ps in per_block for q in ps}
        self._work = {dt: torch.empty(max(sum(q.slot.numel for q in ps if q.param.dtype == dt) for ps in per_block),
                                      dtype=dt, device=self.device) for dt in dtypes}  # one block per dtype
        self._delta = {dt: torch.empty_like(t) for dt, t in self._work.items()}  # eps * z of the block
        if swap_dir is None:
            self.weights: HostWeights | StoreWeights = HostWeights(self.blocks)
        else:
            self.weights = StoreWeights(self.blocks, swap_dir, prefetch=prefetch, init_weights=init_weights,
                                        device=self.device)
        self.prefetch_depth = max(0, int(prefetch)) if swap_dir is not None else 0
        # what a parameter holds between visits: its clean tensor in RAM, or a 0-element
        # placeholder when the disk holds it (a stray forward then fails loudly, never uses stale bytes)
        self._idle = [[q.param.data for q in params] for params in self.blocks.blocks]
        self.log: list = []  # StepRecords, in order
        self.pending = False  # the newest record's update is not yet applied

    @property
    def hyper(self) -> Any:
        """The run's ZO hyper-parameters (those of its rule)."""
        return self.rule.hyper

    def header(self) -> dict[str, Any]:
        """The run-log header (see :mod:`outcore.optim.zo_replay`)."""
        params = [{"name": n, "shape": s, "dtype": d} for n, (s, d) in zip(self.names, self.shapes)]
        return {"schedule": SCHEDULE_EXACT, "seed": self.seed, "hyper": self.hyper.to_dict(), "params": params,
                "backend": self.rule.state.backend}

    def set_backend(self, backend: str | None) -> None:
        """Draw ``z`` as a resumed run's log says it was drawn (``kernels/zo_perturb.py``).

        Raises:
            ConfigError: this machine cannot draw it (a GPU run's noise without a GPU).
        """
        self.rule.state.backend = resolve_backend(backend, self.device)

    def resume_from(self, records: list) -> None:
        """Continue after ``records`` whose updates are already in the weights (see replay).

        Args:
            records: the finished steps of the run, in order (from its log).
        """
        self.log = list(records)
        self.rule.resume(self.log)
        self.pending = False

    def tier_stats(self) -> dict:
        """Per-tier occupancy and traffic of the streamed weights (empty in memory)."""
        return self.weights.tier_stats()

    # -- one block visit -------------------------------------------------------------
    def _prepare(self, b: int, clean: list[torch.Tensor], step: int | None) -> bool:
        """Apply the pending update and (Sparse MeZO) new thresholds to first-visited params."""
        dirty = False
        for q, w in zip(self.blocks.blocks[b], clean):
            if q.index is None or self._first[q.index] != b:
                continue
            if self.pending:
                if not dirty:
                    self.weights.before_update(b)
                self.rule.update_(w, q.index)
                dirty = True
            if step is not None:
                self.rule.refresh_threshold(w, q.index, step)
        return dirty

    def _trainable(self, b: int, clean: list[torch.Tensor]) -> list[tuple[Any, torch.Tensor]]:
        """``(ZOParam, clean tensor)`` of block ``b``'s trainable parameters."""
        return [(q, w) for q, w in zip(self.blocks.blocks[b], clean) if q.index is not None]

    @staticmethod
    def _views(clean: list[torch.Tensor], pool: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Views shaped like ``clean``'s tensors, carved from a one-block scratch pool."""
        offs: dict[torch.dtype, int] = {}
        out = []
        for w in clean:
            o = offs.get(w.dtype, 0)
            out.append(pool[w.dtype][o:o + w.numel()].view(w.shape))
            offs[w.dtype] = o + w.numel()
        return out

    def _draw(self, tr: list[tuple[Any, torch.Tensor]], seed: int, masks: list[torch.Tensor | None]
              ) -> list[torch.Tensor]:
        """``d = fl32(eps * z) * mask`` for every trainable parameter of a block (one z draw serves + and -)."""
        ds = self._views([w for _, w in tr], self._delta)
        for (q, _), d, m in zip(tr, ds, masks):
            self.rule.delta_(d, seed, q.index, m)
        return ds

    def _point(self, b: int, clean: list[torch.Tensor], tr: list, ds: list[torch.Tensor] | None,
               sign: int) -> None:
        """Make block ``b``'s parameters hold ``clean`` (frozen, or ``ds`` None), or ``clean + sign * d``.

        ``clean - d`` is bit-for-bit ``clean + fl32(-eps * z)``: rounding is symmetric in sign.
        """
        for q, w in zip(self.blocks.blocks[b], clean):
            q.param.data = w
        if ds is None:
            return
        for (q, w), d, out in zip(tr, ds, self._views([w for _, w in tr], self._work)):
            (torch.add if sign > 0 else torch.sub)(w, d, out=out)
            q.param.data = out

    def _release(self, b: int, dirty: bool) -> None:
        """Hand block ``b`` back; its parameters then hold the clean weights (RAM) or nothing (disk)."""
        for q, idle in zip(self.blocks.blocks[b], self._idle[b]):
            q.param.data = idle
        self.weights.release(b, dirty)

    def _visits(self):
        """``(b, clean)`` for every block in order, prefetching ``prefetch_depth`` ahead (cyclically:
        the next pass's first blocks are read while this pass's last ones compute)."""
        w = self.weights
        for k in range(self.prefetch_depth):
            w.prefetch(k)
        for b in range(len(self.blocks)):
            clean = w.acquire(b)
            w.prefetch(b + self.prefetch_depth)
            yield b, clean

    # -- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, batch: dict[str, torch.Tensor], lr: float):
        """One ZO step over all blocks (applying the previous step's update on the way).

        Args:
            batch: ``input_ids`` [B, T], optional ``labels`` / ``attention_mask`` [B, T].
            lr: the learning rate of this step's update (applied lazily).

        Returns:
            The step's StepRecord (also appended to ``self.log``).
        """
        if not lr > 0:
            raise ConfigError(f"lr={lr!r} must be > 0")
        t0, stall0 = time.perf_counter(), self.weights.stall_s
        t = len(self.log) + 1
        n = self.hyper.n_samples
        seeds = self.rule.seeds(self.seed, t)
        mine = [i for i in range(n) if self.split == "data" or i % self.world == self.rank]
        ctx = self.blocks.start(to_device(batch, self.device))
        hp: dict[int, Any] = {i: None for i in mine}
        hm: dict[int, Any] = {i: None for i in mine}
        for b, clean in self._visits():
            dirty = self._prepare(b, clean, t)
            tr = self._trainable(b, clean)
            masks = [self.rule.mask(w, q.index) for q, w in tr]
            for i in mine:
                ds = self._draw(tr, seeds[i], masks)
                self._point(b, clean, tr, ds, +1)
                hp[i] = self.blocks.run(b, hp[i], ctx)
                self._point(b, clean, tr, ds, -1)
                hm[i] = self.blocks.run(b, hm[i], ctx)
            del masks
            self._release(b, dirty)
        self.pending = False
        plus = [float("nan")] * n
        minus = [float("nan")] * n
        for i in mine:
            plus[i], minus[i] = float(hp[i]), float(hm[i])  # host sync: the scalars decide the update
        if self.world > 1:
            plus, minus = self.exchange(t, seeds, plus, minus, mine)
        rec = self.rule.record(t, seeds, plus, minus, lr)
        self.pending = True
        self.log.append(rec)
        self.last_stats = StepStats(time.perf_counter() - t0, self.weights.stall_s - stall0)
        return rec

    @torch.no_grad()
    def flush(self) -> None:
        """Apply the pending update to every block (before eval, export or the end)."""
        if not self.pending:
            return
        for b, clean in self._visits():
            self._release(b, self._prepare(b, clean, None))
        self.pending = False

    @torch.no_grad()
    def eval_loss(self, batch: dict[str, torch.Tensor]) -> float:
        """Unperturbed loss on ``batch`` with the current weights (flushes first)."""
        return float(self.forward(batch))

    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The head block's output (``blocks.head``'s, else the loss) on ``batch``, unperturbed,
        with the current weights (flushes first; streams every block once)."""
        self.flush()
        ctx, h = self.blocks.start(to_device(batch, self.device)), None
        for b, clean in self._visits():
            self._point(b, clean, [], None, 0)
            h = self.blocks.run(b, h, ctx)
            self._release(b, False)
        return h

    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the trained parameters by name (flushes first; streams every block once)."""
        self.flush()
        out: dict[str, torch.Tensor] = {}
        for b, clean in self._visits():
            for q, w in self._trainable(b, clean):
                out.setdefault(self.names[q.index], w.clone())
            self.weights.release(b, False)
        return out

    def close(self, flush: bool = True) -> None:
        """Finish I/O and close the weights' store (removing a swap directory).

        Args:
            flush: apply the pending update first. Pass False when a step was cut short
                (an interrupt, an I/O error): its blocks were visited out of the step's
                order and some already hold the pending update, so flushing would apply
                it twice; the run log, not these weights, is what a resume replays.
        """
        try:
            if flush:
                self.flush()
        finally:
            self.weights.close()
