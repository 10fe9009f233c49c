"""Zeroth-order fine-tuning (MeZO / Sparse MeZO): forward passes only, optionally from disk.

Read it top to bottom: ``setup`` loads the model and data and builds the ZO
block trainer (:mod:`outcore.offload.zo.engine`; weights in RAM, or streamed
from NVMe through the tiered store in the swap directory when
``offload=nvme``), ``train`` runs the steps — each one visits every block
once with two forward passes per perturbation sample — and ``cleanup``
evaluates, writes the log and exports ``OUTPUT/final`` by *replaying* the log
onto the base model (the ZO checkpoint is the base weights plus the
(seed, scalar) log, ``OUTPUT/zo_log.jsonl``).

Config: ``method=zo``, ``optim=mezo|sparse-mezo``, ``lr`` (peak, with warmup and
cosine decay), ``weight_decay``, ``max_steps``, ``offload`` (``nvme`` streams the
blocks from ``swap_dir`` through the tiered store; ``none``/``cpu``/``auto`` keep
the weights in RAM), and ``optim_args``:

=================  =======  ==================================================
key                default  meaning
=================  =======  ==================================================
eps                1e-3     perturbation scale
n_samples          1        perturbations (forward pairs) per step
momentum           0.0      windowed ZO momentum factor
momentum_window    0        steps in the momentum window (0 = auto)
sparsity           0.75*    share of entries left out (*sparse-mezo only; 0 for mezo)
mask_every         50       steps between Sparse MeZO threshold recomputations
prefetch           2        blocks read ahead when streaming
lora               false    ZO on LoRA adapters only (lora_r/alpha/targets apply)
=================  =======  ==================================================

Run it:  ``outcore finetune --method zo --optim mezo``
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, Interrupted
from ..events import EvalEvent, EventSink, NullSink, RunFinished, RunStarted, StepEvent, perplexity
from ..offload.device import resolve_device
from ..offload.modes import NVME
from ..training import distributed as dist
from ..training.build import load_zo_model
from ..training.config import FinetuneConfig, load_config
from ..training.loss import mean_eval_loss
from ..training.output_dir import holding_output_dir
from ..training.process import peak_rss_bytes, ram_total_bytes, rss_bytes, set_threads
from ..training.runs import FinetuneResult
from ..training.schedule import lr_lambda
from ..training.signals import StopOnSignal
from ..training.wear import WearMeter
from .export import export_zo_run

_RECIPE_KEYS = ("prefetch", "lora")  # optim_args read here, not by ZOHyper


def zo_options(cfg: FinetuneConfig) -> tuple[Any, dict[str, Any]]:
    """Split ``cfg.optim_args`` into ZO hyper-parameters and recipe options (documented above).

    Raises:
        ConfigError: an unknown key or a bad value.
    """
    from ..optim.zo_core import ZOHyper

    if cfg.grad_accum != 1:
        raise ConfigError(f"grad_accum={cfg.grad_accum} does not apply to method zo (no gradients); "
                          "use optim_args.n_samples or a larger batch_size")
    args = dict(cfg.optim_args)
    recipe = {"prefetch": int(args.pop("prefetch", 2)), "lora": bool(args.pop("lora", False))}
    if cfg.optim == "sparse-mezo":
        args.setdefault("sparsity", 0.75)
        if not args["sparsity"] > 0:
            raise ConfigError(f"optim_args.sparsity={args['sparsity']!r} must be > 0 for optim=sparse-mezo")
    elif args.get("sparsity", 0):
        raise ConfigError(f"optim_args.sparsity={args['sparsity']!r} needs optim=sparse-mezo")
    return ZOHyper.from_args({"weight_decay": cfg.weight_decay, **args}), recipe


class ZORecipe:
    """One ZO run. ``run()`` = setup → train → cleanup."""

    def __init__(self, config: FinetuneConfig, sink: EventSink | None = None) -> None:
        if config.method != "zo":
            raise ConfigError(f"method={config.method!r}: the ZO recipe runs method 'zo' only")
        self.cfg, self._sink = config, sink

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from ..data import BatchLoader, build_datasets, check_seq_len
        from ..offload.zo import ZOBlockTrainer
        from ..optim.zo_replay import ZOLog, ZOLogWriter, replay_into_

        cfg = self.cfg
        self.ranks, self.joined = dist.join_run(cfg)  # under torchrun: this rank (training/distributed.py)
        set_threads(dist.rank_threads(cfg.threads, self.ranks))
        self.device = resolve_device(cfg.device)
        self.hyper, opts = zo_options(cfg)
        self.out, self.out_lock = dist.prepare_run_dir(cfg, self.ranks)
        self.sink = self._sink or NullSink()
        lora = ({"r": cfg.lora_r, "alpha": cfg.lora_alpha, "targets": list(cfg.lora_targets)}
                if opts["lora"] else None)
        self.model, self.tokenizer, _ = load_zo_model(cfg.model, cfg.dtype, cfg.seed, lora)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        check_seq_len(self.model, cfg.seq_len)
        self.train_set, self.val_set = build_datasets(
            cfg.data, self.tokenizer, cfg.seq_len, seed=cfg.seed,
            val_fraction=cfg.val_fraction, max_bytes=cfg.data_max_bytes)
        self.loader = BatchLoader(self.train_set, cfg.batch_size, seed=cfg.seed)

        previous = ZOLog.load(self.out) if cfg.resume else None
        if previous is not None and previous.damaged:  # its valid steps are the newest checkpoint
            print(f"outcore: warning: {previous.damaged}; resuming from step {len(previous.records)} instead",
                  file=sys.stderr)
        if cfg.offload != NVME:  # in memory: on the compute device (streamed: the units go there)
            self.model.to(self.device)
        if previous is not None:  # resume = replay the log onto the base, then go on
            replay_into_(dict(self.model.named_parameters()), previous)
            for _ in previous.records:
                self.loader.next_batch()  # the data order continues where the run stopped
        self.swap = None
        if cfg.offload == NVME:
            # the store makes the swap dir (0700, locked) and removes it on close: only what it
            # created, never a directory the user named that already held files
            self.swap = dist.rank_swap_dir(Path(cfg.swap_dir or self.out / "swap"), self.ranks)
            self.swap.parent.mkdir(parents=True, exist_ok=True)
        self.trainer = ZOBlockTrainer(self.model, self.hyper, seed=cfg.seed,
                                      swap_dir=None if self.swap is None else str(self.swap),
                                      prefetch=opts["prefetch"], device=self.device,
                                      **dist.zo_split(self.ranks, self.out))
        if previous is not None:
            self.trainer.set_backend(previous.header.get("backend"))  # z drawn as the run drew it
        header = {**self.trainer.header(),
                  "base": {"kind": "model", "model": cfg.model, "dtype": cfg.dtype, "lora": lora}}
        if previous is not None:
            if previous.header["params"] != header["params"] or previous.header["hyper"] != header["hyper"]:
                raise CheckpointError(f"--resume {cfg.resume!r}: the ZO log was written by another "
                                      "model or other optim_args; start a new run")
            self.trainer.resume_from(previous.records)
        dist.barrier(self.ranks, "the ZO log's reading", self.out)  # before rank 0 rewrites it
        self.writer = ZOLogWriter(self.out, header) if self.ranks.is_main else None  # rank 0 writes the log
        for rec in self.trainer.log if self.writer else ():
            self.writer.append(rec)
        self.lr_at = lr_lambda(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        self.base_eval_loss: float | None = None

    # ------------------------------------------------------------------ train
    def train(self) -> None:
        cfg, tr = self.cfg, self.trainer
        store = getattr(tr.weights, "store", None)  # streamed from NVMe; in memory: none
        self.wear = WearMeter(store, cfg.ssd_tbw, self.swap or self.out / "swap", self.out, len(tr.log))
        self.sink.emit(RunStarted(run_name=self.out.name, model=cfg.model, n_params=self.n_params,
                                  n_trainable=self.n_trainable, total_steps=cfg.max_steps, output_dir=str(self.out),
                                  method=cfg.method, optim=cfg.optim, config=cfg.to_dict()))
        self.base_eval_loss = self._eval(len(tr.log))
        self.losses: list[float] = []
        tokens_per_step = cfg.batch_size * cfg.seq_len
        t_start = time.perf_counter()
        while len(tr.log) < cfg.max_steps:
            dist.check_stop(self.stop, self.ranks, self.out)  # a signal during the last step: stop here
            t = len(tr.log)
            lr = cfg.lr * self.lr_at(t)
            rec = tr.step(self.loader.next_batch(), lr=lr)
            if self.writer:
                self.writer.append(rec)  # the (seed, scalar) record is the checkpoint
            if not math.isfinite(rec.loss):
                raise FloatingPointError(f"ZO loss became {rec.loss} at step {rec.step}; lower lr or eps")
            stats = tr.last_stats
            eval_loss = None
            if cfg.eval_every and rec.step % cfg.eval_every == 0 and rec.step < cfg.max_steps:
                eval_loss = self._eval(rec.step)
            if rec.step % cfg.log_every == 0 or rec.step == cfg.max_steps or eval_loss is not None:
                self.losses.append(rec.loss)
                tiers = tr.tier_stats()  # the store's counters, bandwidth since the last log line
                self.sink.emit(dist.with_ranks(self.ranks, self.wear.fill(StepEvent(
                    step=rec.step, total_steps=cfg.max_steps, loss=rec.loss, lr=lr,
                    tokens_per_s=tokens_per_step / stats.step_s, step_s=stats.step_s,
                    elapsed_s=time.perf_counter() - t_start, rss_bytes=rss_bytes(),
                    ram_bytes=ram_total_bytes(), eval_loss=eval_loss, stall_s=stats.stall_s, tiers=tiers)), self.out))
        dist.check_stop(self.stop, self.ranks, self.out)

    def _eval(self, step: int) -> float:
        loss = mean_eval_loss(self.trainer.eval_loss, self.val_set, self.cfg.batch_size, self.cfg.eval_batches)
        self.sink.emit(EvalEvent(step=step, eval_loss=loss, perplexity=perplexity(loss)))
        return loss

    # ---------------------------------------------------------------- cleanup
    def cleanup(self, interrupted: bool = False) -> FinetuneResult:
        final_eval = final_dir = None
        if not interrupted:
            final_eval = self._eval(len(self.trainer.log))
        self._close(flush=not interrupted)
        if not interrupted and self.cfg.export and self.ranks.is_main:
            final_dir = export_zo_run(self.out, self.out / "final")
        self.sink.emit(self.wear.fill(RunFinished(
            steps_done=len(self.trainer.log), wall_s=time.perf_counter() - self._t0, peak_rss_bytes=peak_rss_bytes(),
            output_dir=str(self.out), base_eval_loss=self.base_eval_loss, final_eval_loss=final_eval,
            interrupted=interrupted, final_dir=None if final_dir is None else str(final_dir))))
        self.sink.close()
        return FinetuneResult(output_dir=self.out, steps_done=len(self.trainer.log), final_dir=final_dir,
                              base_eval_loss=self.base_eval_loss, final_eval_loss=final_eval,
                              losses=getattr(self, "losses", []), interrupted=interrupted)

    def _close(self, flush: bool) -> None:
        """Close the trainer (its store removes the swap directory; without the pending update
        when a step may have been cut: see ``ZOBlockTrainer.close``) and the log, which with the
        base weights is the run's checkpoint."""
        try:
            if getattr(self, "trainer", None) is not None:
                self.trainer.close(flush=flush)
        finally:
            if getattr(self, "writer", None) is not None:
                self.writer.close()

    def run(self) -> FinetuneResult:
        """setup → train → cleanup. SIGINT / SIGTERM stop the run at the end of its step (every
        finished step is already in the log, the run's checkpoint); reported and re-raised."""
        self._t0 = time.perf_counter()
        with StopOnSignal() as self.stop, holding_output_dir(self), dist.leaving_group(self):
            try:
                self.setup()
            except BaseException:
                self._abort()
                raise
            try:
                self.stop.deferring = True  # signals wait for the end of the step
                self.train()
                self.stop.deferring = False
            except KeyboardInterrupt as e:
                self.stop.deferring = False
                if isinstance(e, Interrupted):
                    e.step, e.output = len(self.trainer.log), str(self.out)
                self.cleanup(interrupted=True)
                raise
            except BaseException:
                self._abort()
                raise
            return self.cleanup()

    def _abort(self) -> None:
        """A failed run: close what setup built (the swap directory removed), report nothing more."""
        try:
            self._close(flush=False)
        finally:
            if getattr(self, "sink", None) is not None:
                self.sink.close()


def finetune(config: FinetuneConfig, sink: EventSink | None = None) -> FinetuneResult:
    """Fine-tune with MeZO / Sparse MeZO as ``config`` says (``config.method == "zo"``).

    Args:
        config: the run's config (``optim`` mezo or sparse-mezo; options in ``optim_args``).
        sink: where events go (the caller's dashboard or log; None: nowhere).

    Returns:
        A FinetuneResult (output dir, steps, eval losses, final export dir); the run
        log is ``OUTPUT/zo_log.jsonl``.

    Raises:
        OutcoreError: bad config, model, data or checkpoint (one-line message).
    """
    return ZORecipe(config, sink).run()


if __name__ == "__main__":
    finetune(load_config(overrides=["method=zo", "optim=mezo", *sys.argv[1:]]))
