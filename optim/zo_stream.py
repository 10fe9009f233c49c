"""The ZO block schedule (ZO2's dual forward), in memory or streamed from disk.

Each step visits every block once, in order (ARCHITECTURE.md §5). At block ``b``:

1. ``clean = source.acquire(b)`` — the block's authoritative weights (RAM, or
   read from NVMe through :class:`outcore.offload.TieredStore` ahead of time,
   while earlier blocks computed; see :mod:`outcore.optim.zo_sources`);
2. the *previous* step's update is applied to ``clean`` in place (lazy update:
   its projected gradients were only known after the previous step's last
   block), then ``source.release`` writes the block back — in place on disk;
3. for each perturbation sample: the block's parameters are pointed at a
   scratch buffer holding ``clean + eps z`` to advance that sample's "+"
   hidden state, then at ``clean - eps z`` for its "-" hidden state.
   ``clean`` itself is never perturbed, so it is restored *exactly* (no fp32
   drift from ``+eps, -2 eps, +eps``) and the z of one block is regenerated
   from ``(seed, parameter index)``, never stored.

After the head block the losses give the projected gradients; the step's
(seed, scalar) record goes to the run log. :meth:`ZOBlockTrainer.flush` applies
the last pending update. With the same seeds, the in-memory source, the disk
source and :func:`outcore.optim.zo_replay.replay` (schedule ``"exact"``) give
bit-identical weights. Distributed ZO plugs in through ``exchange``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ConfigError
from .zo_blocks import CausalLMBlocks, trainable_parameters
from .zo_core import (StepRecord, ZOHyper, ZOState, apply_update_, mask_for, needs_thresholds, perturb_,
                      projected_grads, sample_seeds, threshold_of)
from .zo_sources import BlockSource, FileBlockSource, HostBlockSource, StoreBlockSource

SCHEDULE_EXACT = "exact"

# exchange(step, seeds, plus, minus, mine) -> (plus, minus) for all samples; see zo_distributed
Exchange = Callable[[int, list[int], list[float], list[float], list[int]], tuple[list[float], list[float]]]


@dataclass
class StepStats:
    """What one ZO step cost (for StepEvent)."""

    step_s: float
    stall_s: float  # time waiting on the disk
    read_bytes: int
    written_bytes: int


class ZOBlockTrainer:
    """MeZO / Sparse MeZO over a causal LM, one block at a time.

    Args:
        model: a Hugging Face decoder-only causal LM (fp32 for bit-exact claims).
        hyper: ZO hyper-parameters.
        seed: run seed (step ``t``'s samples use ``sample_seeds(seed, t, n)``).
        swap_dir: None keeps the weights in RAM; a directory streams them from
            files there (``FileBlockSource``), leaving the model's streamed
            parameters empty between visits.
        prefetch: blocks read ahead when streaming.
        rank, world: this process's share of the samples (sample ``i`` runs on
            rank ``i % world``); ``exchange`` must then combine the losses.
        exchange: combines per-rank losses into all samples' losses.
        split: ``"samples"`` (rank r evaluates samples i with i % world == r on the same
            batch) or ``"data"`` (every rank evaluates every sample on its own batch and
            the losses are averaged over ranks).
        backend: with ``swap_dir``: ``"store"`` streams through
            :class:`outcore.offload.TieredStore` (budgeted HOST tier, checksummed
            extents; the swap dir is removed on close), ``"files"`` through the
            minimal :class:`FileBlockSource` (one O_DIRECT file per block).
        materialize: with ``swap_dir``, called per block before it is written to disk
            (initialize a ``meta``-device model block by block; see FileBlockSource).

    Raises:
        ConfigError: ``world`` / ``rank`` inconsistent, or ``exchange`` missing with world > 1.
    """

    def __init__(self, model: torch.nn.Module, hyper: ZOHyper, seed: int = 0, swap_dir: str | None = None,
                 prefetch: int = 2, rank: int = 0, world: int = 1, exchange: Exchange | None = None,
                 split: str = "samples", materialize: Callable[..., None] | None = None,
                 backend: str = "store") -> None:
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"rank={rank}, world={world}: need world >= 1 and 0 <= rank < world")
        if world > 1 and exchange is None:
            raise ConfigError(f"world={world} needs an exchange function (see outcore.optim.zo_distributed)")
        if split not in ("samples", "data"):
            raise ConfigError(f"split={split!r} must be 'samples' or 'data'")
        self.split = split
        self.model, self.hyper, self.seed = model, hyper, int(seed)
        self.rank, self.world, self.exchange = rank, world, exchange
        self.blocks = CausalLMBlocks(model)
        self.names = [n for n, _ in trainable_parameters(model)]
        if not self.names:
            raise ConfigError(f"{type(model).__name__} has no parameter with requires_grad=True; "
                              "unfreeze what ZO should train")
        self.shapes = [(list(p.shape), str(p.dtype).replace("torch.", "")) for _, p in trainable_parameters(model)]
        bl = self.blocks.blocks
        dtypes = {p.dtype for blk in bl for _, p in blk.params}
        self._work = {dt: torch.empty(max(sum(p.numel() for _, p in blk.params if p.dtype == dt) for blk in bl),
                                      dtype=dt) for dt in dtypes}  # one block of scratch per dtype
        self._delta = {dt: torch.empty_like(t) for dt, t in self._work.items()}  # eps * z of the block
        if backend not in ("store", "files"):
            raise ConfigError(f"backend={backend!r} must be 'store' or 'files'")
        self.source: BlockSource
        if swap_dir is None:
            self.source = HostBlockSource(bl)
        elif backend == "store":
            self.source = StoreBlockSource(bl, swap_dir, prefetch=prefetch, materialize=materialize)
        else:
            self.source = FileBlockSource(bl, swap_dir, prefetch=prefetch, materialize=materialize)
        self.prefetch_depth = prefetch if swap_dir is not None else 0
        # what a parameter holds between visits: its clean tensor in RAM, or a 0-element
        # placeholder when the disk holds it (a stray forward then fails loudly, never uses stale bytes)
        self._home = {j: p.data for blk in bl for j, p in blk.params}
        self.state = ZOState(hyper, thresholds=[0.0] * len(self.names) if hyper.sparsity > 0 else None)
        self.log: list[StepRecord] = []
        self.pending = False  # the newest record's update is not yet applied
        first: dict[int, int] = {}
        for b, blk in enumerate(bl):
            for j, _ in blk.params:
                first.setdefault(j, b)
        self._first = first  # block where each parameter is updated (its first visit)

    def header(self) -> dict[str, Any]:
        """The run-log header (see :mod:`outcore.optim.zo_replay`)."""
        return {"schedule": SCHEDULE_EXACT, "seed": self.seed, "hyper": self.hyper.to_dict(),
                "params": [{"name": n, "shape": s, "dtype": d} for n, (s, d) in zip(self.names, self.shapes)],
                "backend": "torch"}

    def resume_from(self, records: list[StepRecord]) -> None:
        """Continue after ``records`` whose updates are already in the weights (see replay).

        Args:
            records: the finished steps of the run, in order (from its log).
        """
        self.log = list(records)
        self.state.history = self.log[-self.hyper.window:]
        for rec in self.log:
            if rec.thresholds is not None:
                self.state.thresholds = list(rec.thresholds)
        self.pending = False

    # -- one block visit -------------------------------------------------------------
    def _prepare(self, b: int, clean: list[torch.Tensor], step: int | None) -> bool:
        """Apply the pending update and (Sparse MeZO) new thresholds to first-visited params."""
        dirty = False
        for (j, _), w in zip(self.blocks.blocks[b].params, clean):
            if self._first[j] != b:
                continue
            if self.pending:
                apply_update_(w, j, self.state)
                dirty = True
            if step is not None and needs_thresholds(self.hyper, step):
                self.state.thresholds[j] = threshold_of(w, self.hyper.sparsity)
        return dirty

    def _views(self, b: int, clean: list[torch.Tensor], pool: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter views of block ``b``'s shape carved from a one-block scratch pool."""
        offs: dict[torch.dtype, int] = {}
        out = []
        for w in clean:
            o = offs.get(w.dtype, 0)
            out.append(pool[w.dtype][o:o + w.numel()].view(w.shape))
            offs[w.dtype] = o + w.numel()
        return out

    def _draw(self, b: int, clean: list[torch.Tensor], seed: int, masks: list[torch.Tensor | None]
              ) -> list[torch.Tensor]:
        """``d = fl32(eps * z) * mask`` for every parameter of block ``b`` (one z draw serves + and -)."""
        ds = self._views(b, clean, self._delta)
        for (j, _), d, m in zip(self.blocks.blocks[b].params, ds, masks):
            d.zero_()
            perturb_(d, seed, j, self.hyper.eps, m)  # 0 + d == d exactly
        return ds

    def _point(self, b: int, clean: list[torch.Tensor], ds: list[torch.Tensor] | None, sign: int) -> None:
        """Make block ``b``'s parameters hold ``clean + sign * d`` (or ``clean`` when ``ds`` is None).

        ``clean - d`` is bit-for-bit ``clean + fl32(-eps * z)``: rounding is symmetric in sign.
        """
        works = self._views(b, clean, self._work) if ds is not None else clean
        for k, ((_, p), w) in enumerate(zip(self.blocks.blocks[b].params, clean)):
            if ds is not None:
                (torch.add if sign > 0 else torch.sub)(w, ds[k], out=works[k])
            p.data = works[k]

    def _release(self, b: int, dirty: bool) -> None:
        """Hand block ``b`` back; its parameters then hold the clean weights (RAM) or nothing (disk)."""
        for j, p in self.blocks.blocks[b].params:
            p.data = self._home[j]
        self.source.release(b, dirty)

    # -- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, batch: dict[str, torch.Tensor], lr: float) -> StepRecord:
        """One ZO step over all blocks (applying the previous step's update on the way).

        Args:
            batch: ``input_ids`` [B, T], optional ``labels`` / ``attention_mask`` [B, T].
            lr: the learning rate of this step's update (applied lazily).

        Returns:
            The step's record (also appended to ``self.log``).
        """
        if not lr > 0:
            raise ConfigError(f"lr={lr!r} must be > 0")
        t0 = time.perf_counter()
        src = self.source
        stall0, rd0, wr0 = src.stall_s, src.read_bytes, src.written_bytes
        t = len(self.log) + 1
        n = self.hyper.n_samples
        seeds = sample_seeds(self.seed, t, n)
        mine = [i for i in range(n) if self.split == "data" or i % self.world == self.rank]
        ctx = self.blocks.start(batch)
        hp: dict[int, Any] = {i: None for i in mine}
        hm: dict[int, Any] = {i: None for i in mine}
        nb = len(self.blocks)
        for k in range(1, self.prefetch_depth + 1):
            src.prefetch(k - 1)
        for b in range(nb):
            clean = src.acquire(b)
            src.prefetch(b + self.prefetch_depth)
            dirty = self._prepare(b, clean, t)
            masks = [mask_for(w, self.state, j) for (j, _), w in zip(self.blocks.blocks[b].params, clean)]
            for i in mine:
                ds = self._draw(b, clean, seeds[i], masks)
                self._point(b, clean, ds, +1)
                hp[i] = self.blocks.run(b, hp[i], ctx)
                self._point(b, clean, ds, -1)
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
        rec = StepRecord(step=t, seeds=seeds, grads=projected_grads(plus, minus, self.hyper.eps), lr=float(lr),
                         loss=(sum(plus) + sum(minus)) / (2 * n),
                         thresholds=list(self.state.thresholds) if needs_thresholds(self.hyper, t) else None)
        self.state.push(rec)
        self.pending = True
        self.log.append(rec)
        self.last_stats = StepStats(time.perf_counter() - t0, src.stall_s - stall0,
                                    src.read_bytes - rd0, src.written_bytes - wr0)
        return rec

    @torch.no_grad()
    def flush(self) -> None:
        """Apply the pending update to every block (before eval, export or the end)."""
        if not self.pending:
            return
        src = self.source
        for k in range(self.prefetch_depth):
            src.prefetch(k)
        for b in range(len(self.blocks)):
            clean = src.acquire(b)
            src.prefetch(b + self.prefetch_depth)
            dirty = self._prepare(b, clean, None)
            self._release(b, dirty)
        self.pending = False

    @torch.no_grad()
    def eval_loss(self, batch: dict[str, torch.Tensor]) -> float:
        """Unperturbed loss on ``batch`` with the current weights (flushes first)."""
        self.flush()
        src, ctx, h = self.source, self.blocks.start(batch), None
        for k in range(self.prefetch_depth):
            src.prefetch(k)
        for b in range(len(self.blocks)):
            clean = src.acquire(b)
            src.prefetch(b + self.prefetch_depth)
            self._point(b, clean, None, 0)
            h = self.blocks.run(b, h, ctx)
            self._release(b, False)
        return float(h)

    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the trained parameters by name (flushes first; streams every block once)."""
        self.flush()
        out: dict[str, torch.Tensor] = {}
        src = self.source
        for b in range(len(self.blocks)):
            clean = src.acquire(b)
            for (j, _), w in zip(self.blocks.blocks[b].params, clean):
                out.setdefault(self.names[j], w.clone())
            src.release(b, False)
        return out

    def close(self) -> None:
        """Flush, finish I/O and close the source."""
        self.flush()
        self.source.close()
