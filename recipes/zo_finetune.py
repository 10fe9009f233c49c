"""Zeroth-order fine-tuning (MeZO / Sparse MeZO): forward passes only, optionally from disk.

Read it top to bottom: ``setup`` loads the model and data and builds the ZO
block trainer (:mod:`outcore.offload.zo.engine`; weights in RAM, or streamed
from NVMe through the tiered store in the swap directory when
``offload=nvme``); ``step`` is one step — it visits every block once with two
forward passes per perturbation sample — and appends its (seed, scalar) record to
the log; ``export`` writes ``OUTPUT/final`` by *replaying* the log onto the base
model. The ZO checkpoint is the base weights plus that log, ``OUTPUT/zo_log.jsonl``,
so ``save`` has nothing to write. The run around the recipe (output directory,
signals, ranks, events, evals) is ``training/lifecycle.py``'s, as for every method.

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
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from ..events import EventSink
from ..methods import objective
from ..offload.modes import NVME
from ..training import distributed as dist
from ..training.build import load_zo_model
from ..training.config import FinetuneConfig, load_config
from ..training.lifecycle import Built, Evaluation, Run, Stepped
from ..training.loss import mean_eval_loss
from ..training.runs import FinetuneResult
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
    """MeZO / Sparse MeZO (``method=zo``): every block once per step, two forward passes per
    perturbation sample, the weights in RAM or streamed from NVMe.

    Args:
        run: the run it is part of (its config, ranks, device and output directory).

    Raises:
        ConfigError: another method, or bad ``optim_args`` (before any work).
    """

    def __init__(self, run: Run) -> None:
        if run.cfg.method != "zo":
            raise ConfigError(f"method={run.cfg.method!r}: the ZO recipe runs method 'zo' only")
        self.run, self.cfg = run, run.cfg
        self.hyper, self.opts = zo_options(self.cfg)
        self._resources = ExitStack()  # the trainer (its store, the swap dir) and the log file

    # ------------------------------------------------------------------ setup
    def setup(self) -> Built:
        """Load the model (replaying the log onto it to resume) and the data; build the trainer
        and reopen the log, which with the base weights is the run's checkpoint.

        Raises:
            OutcoreError: bad model, data or log.
        """
        from ..data import BatchLoader, check_seq_len
        from ..models import check_packed_documents
        from ..offload.zo import ZOBlockTrainer
        from ..offload.zo import StoreWeights
        from ..optim.zo_replay import ZOLog, ZOLogWriter, replay_into_

        cfg, run = self.cfg, self.run
        lora = ({"r": cfg.lora_r, "alpha": cfg.lora_alpha, "targets": list(cfg.lora_targets)}
                if self.opts["lora"] else None)
        self.model, self.tokenizer, _ = load_zo_model(cfg.model, cfg.dtype, cfg.seed, lora)
        n_params = sum(p.numel() for p in self.model.parameters())
        n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        check_seq_len(self.model, cfg.seq_len)
        if cfg.padding_free:  # a packed row's documents kept apart, or one line
            check_packed_documents(self.model)
        self.train_set, self.val_set = self._datasets()
        self.loader = BatchLoader(self.train_set, cfg.batch_size, seed=cfg.seed)

        previous = ZOLog.load(run.out) if cfg.resume else None
        if previous is not None and previous.damaged:  # its valid steps are the newest checkpoint
            print(f"outcore: warning: {previous.damaged}; resuming from step {len(previous.records)} instead",
                  file=sys.stderr)
        if cfg.offload != NVME:  # in memory: on the compute device (streamed: the units go there)
            self.model.to(run.device)
        if previous is not None:  # resume = replay the log onto the base, then go on
            replay_into_(dict(self.model.named_parameters()), previous)
            for _ in previous.records:
                self.loader.next_batch()  # the data order continues where the run stopped
        swap = None
        if cfg.offload == NVME:
            # the store makes the swap dir (0700, locked) and removes it on close: only what it
            # created, never a directory the user named that already held files
            swap = dist.rank_swap_dir(Path(cfg.swap_dir or run.out / "swap"), run.ranks)
            swap.parent.mkdir(parents=True, exist_ok=True)
        self.trainer = ZOBlockTrainer(self.model, self.hyper, seed=cfg.seed,
                                      swap_dir=None if swap is None else str(swap), prefetch=self.opts["prefetch"],
                                      device=run.device, **dist.zo_split(run.ranks, run.out))
        # (closed without the pending update: close() applies it first when the run completed)
        self._resources.callback(self.trainer.close, flush=False)
        if previous is not None:
            self.trainer.set_backend(previous.header.get("backend"))  # z drawn as the run drew it
        self._prepare()
        header = {**self.trainer.header(),
                  "base": {"kind": "model", "model": cfg.model, "dtype": cfg.dtype, "lora": lora}}
        if previous is not None:
            if previous.header["params"] != header["params"] or previous.header["hyper"] != header["hyper"]:
                raise CheckpointError(f"--resume {cfg.resume!r}: the ZO log was written by another "
                                      "model or other optim_args; start a new run")
            self.trainer.resume_from(previous.records)
        dist.barrier(run.ranks, "the ZO log's reading", run.out)  # before rank 0 rewrites it
        self.writer = ZOLogWriter(run.out, header) if run.ranks.is_main else None  # rank 0 writes the log
        if self.writer is not None:
            self._resources.callback(self.writer.close)
            for rec in self.trainer.log:
                self.writer.append(rec)
        weights = self.trainer.weights
        rows = cfg.batch_size * objective(cfg.objective).rows_per_example  # (a preference pair is two rows)
        return Built(n_params, n_trainable, tokens_per_step=rows * cfg.seq_len,
                     store=weights.store if isinstance(weights, StoreWeights) else None, swap_dir=swap,
                     checkpoint_step=len(self.trainer.log))  # the log is a checkpoint, of step 0 too

    def _datasets(self) -> tuple[Any, Any]:
        """``(train, val)``: the run's token rows."""
        from ..data import build_datasets

        cfg = self.cfg
        return build_datasets(cfg.data, self.tokenizer, cfg.seq_len, seed=cfg.seed, val_fraction=cfg.val_fraction,
                              max_bytes=cfg.data_max_bytes, padding_free=cfg.padding_free)

    def _prepare(self) -> None:
        """What an objective adds once the trainer holds the weights (before a resumed log's
        steps are known to it): the next-token loss adds nothing."""

    # ------------------------------------------------------------------ train
    def step(self, lr: float) -> Stepped:
        """One ZO step on the next batch; its (seed, scalar) record, appended to the log, is its checkpoint.

        Raises:
            FloatingPointError: the loss became NaN or infinite (before a bad record is logged on).
        """
        rec = self.trainer.step(self.loader.next_batch(), lr=lr)
        if self.writer is not None:
            self.writer.append(rec)
        if not math.isfinite(rec.loss):
            raise FloatingPointError(f"ZO loss became {rec.loss} at step {rec.step}; lower lr or eps")
        return Stepped(rec.loss, checkpointed=True)

    def evaluate(self, step: int) -> Evaluation:
        """The held-out loss (forward passes of the current weights)."""
        return Evaluation(mean_eval_loss(self.trainer.eval_loss, self.val_set, self.cfg.batch_size,
                                         self.cfg.eval_batches))

    def save(self) -> None:
        """Nothing to write: every finished step is in the log already."""

    # ---------------------------------------------------------------- the end
    def export(self, out_dir: Path) -> Path:
        """The trained model, by replaying the log onto the base model."""
        return export_zo_run(self.run.out, out_dir)

    def close(self, completed: bool) -> None:
        """Close the trainer (its store removes the swap directory) and the log. A completed run's
        pending update is applied first; not after a step that may have been cut: its blocks
        were visited out of order and some hold it already (see ``ZOBlockTrainer.close``)."""
        with self._resources:
            if completed:
                self.trainer.flush()


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
    return Run(config, sink).execute(ZORecipe)


if __name__ == "__main__":
    finetune(load_config(overrides=["method=zo", "optim=mezo", *sys.argv[1:]]))
