"""Full (or LoRA) fine-tuning of a causal LM: the readable reference recipe.

Read it top to bottom: ``setup`` builds everything from a ``FinetuneConfig``,
``train`` runs the optimizer steps, ``cleanup`` evaluates, exports and closes.
The model trains behind one interface, ``train_step(loss_fn, micro_batches, lr)``:
an ``InMemoryModel`` (the numerical reference every out-of-core mode is checked
against: same seed + fp32 ⇒ same weights, bit for bit) or an ``OutOfCoreEngine``
whose weights and optimizer state stream through the tiers.

The recipe receives its event sink; with none it reports nothing (``outcore.finetune``
and ``outcore finetune`` give it the dashboard or plain log and ``metrics.jsonl``).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..activations.policy import OFFLOAD, ActivationPolicy
from .._faults import fault_point
from ..dtypes import torch_dtype
from ..errors import ConfigError, Interrupted
from ..events import EvalEvent, EventSink, NullSink, RunFinished, RunStarted, StepEvent, TaskEvalEvent, perplexity
from ..offload.device import device_memory, resolve_device
from ..training import checkpoint as ckpt
from ..training import distributed as dist
from ..training.build import (build_optimizer, check_offload_supported, make_plan, offload_from_plan, swap_dir_of,
                              with_lora)
from ..training.config import FinetuneConfig
from ..training.dcp import restore_trainable, restore_units, save_distributed
from ..training.in_memory import InMemoryModel
from ..training.loss import CausalLMScorer, mean_eval_loss
from ..training.output_dir import holding_output_dir
from ..training.process import peak_rss_bytes, ram_total_bytes, rss_bytes, set_threads
from ..training.runs import FinetuneResult
from ..training.schedule import lr_lambda
from ..training.signals import StopOnSignal
from ..training.wear import WearMeter
from .evaluate import score_task
from .export import export_hf, export_offloaded

# A run stopped by a signal writes a checkpoint unless its newest one is younger than
# this: a few seconds of steps are cheaper to redo than a large model's checkpoint to write.
RECENT_CHECKPOINT_S = 10.0


class Recipe:
    """One fine-tuning run. ``run()`` = setup → train → cleanup.

    Args:
        config: the run's config (``method`` full, lora or qlora).
        sink: where events go (default: ``NullSink``, nothing reported).

    Raises:
        ConfigError: ``method="zo"`` (the ZO recipe runs it).
    """

    def __init__(self, config: FinetuneConfig, sink: EventSink | None = None):
        if config.zeroth_order:
            raise ConfigError("method='zo' runs in recipes.zo_finetune; call outcore.finetune, which picks the recipe")
        self.cfg = config
        self.sink = sink if sink is not None else NullSink()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build the run: output dir, model (in memory or streamed), data, loss, optimizer, resume.

        Raises:
            OutcoreError: bad config, model, data, output directory or checkpoint.
        """
        from ..data import BatchLoader, build_datasets, check_seq_len
        from ..data.tasks import load_task
        from ..models import load_model, load_model_lazily

        cfg = self.cfg
        self.ranks, self.joined = dist.join_run(cfg)  # under torchrun: this rank (training/distributed.py)
        self.device = resolve_device(cfg.device)  # (after join_run: under torchrun, this rank's GPU)
        set_threads(dist.rank_threads(cfg.threads, self.ranks))
        torch.manual_seed(cfg.seed)
        self.task = load_task(cfg.eval_task) if cfg.eval_task else None  # a bad file fails before any work
        self.out, self.out_lock = dist.prepare_run_dir(cfg, self.ranks)

        self.plan, fill = None, None
        self.lora = cfg.uses_adapters
        if cfg.offload != "none":
            # Out of core, the weights go straight from their files into the store,
            # unit by unit: the model is built on the meta device, never whole in RAM.
            check_offload_supported(cfg)
            self.model, self.tokenizer, fill = load_model_lazily(cfg.model, dtype=torch_dtype(cfg.dtype))
            self.plan = make_plan(cfg, self.model)
            if self.plan.layout == "none":  # `auto` found that everything fits in memory
                self.plan.notes.append("everything fits in memory: training in memory")
                self.model, fill = None, None
        if fill is None:
            self.model, self.tokenizer = load_model(cfg.model, dtype=torch_dtype(cfg.dtype),
                                                    quantize_4bit=cfg.quantizes_base)
        check_seq_len(self.model, cfg.seq_len)
        if self.lora:
            self.model = with_lora(self.model, cfg)
        if fill is None:  # in memory: the whole model on the compute device (out of core the engine places it)
            self.model.to(self.device)
        self.model.train()
        # The KV cache is for generation; in training it only costs memory.
        self.model.config.use_cache = False

        self.train_set, self.val_set = build_datasets(
            cfg.data, self.tokenizer, cfg.seq_len, seed=cfg.seed,
            val_fraction=cfg.val_fraction, max_bytes=cfg.data_max_bytes)
        self.loader = BatchLoader(self.train_set, cfg.batch_size, seed=cfg.seed)

        self._setup_loss()
        self._setup_trainer(fill)
        self._setup_activations()
        self.lr_at = lr_lambda(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        self.step = 0
        self.base_eval_loss: float | None = None
        if cfg.resume:
            self._restore()

    def _setup_loss(self) -> None:
        self.scorer = CausalLMScorer(self.model, self.device)  # the loss, and the task's log-likelihoods
        self.head_loss = self.scorer.head_loss  # out of core, a unit of the head (offload_from_plan)

    def _setup_trainer(self, fill: Callable[[str, torch.Tensor], None] | None) -> None:
        """The optimizer, and the model behind ``train_step``: in memory, or streamed when
        the model was built on the meta device (``fill`` reads its weights)."""
        cfg = self.cfg
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if fill is None:
            self.optimizer = build_optimizer(cfg, self.params)
            self.trainer = InMemoryModel(self.model, self.optimizer, self.params, cfg.max_grad_norm,
                                         self.ranks, str(self.out))
        else:
            # Full fine-tune: the optimizer streams its state with the units. LoRA: the
            # adapters and their state stay resident; only the frozen base streams.
            self.optimizer = build_optimizer(cfg, self.params, streaming=not self.lora)
            engine = offload_from_plan(cfg, self.model, self.optimizer, self.plan, self.out, self.head_loss, fill,
                                       self.ranks, self.device)
            self.trainer = dist.data_parallel(engine, self.ranks, str(self.out))  # LoRA under torchrun
        self.streamed = fill is not None
        # Out of core, a full fine-tune's weights and optimizer state live in the store and
        # are checkpointed unit by unit from there; otherwise the model and optimizer hold them.
        self.units_in_store = self.streamed and not self.lora

    def _setup_activations(self) -> None:
        """What each block keeps for its backward: the plan resolves `auto` when there is one."""
        policy = self.plan.activations if self.plan is not None else self.cfg.activations
        self.activations = None
        if policy != ActivationPolicy.KEEP.value:
            from ..activations import apply_activation_policy
            from ..models import unwrap_peft

            # Offloaded activations go to the run's store: its swap dir (the disk the user
            # chose) and its traffic counters, not a private store in the temp dir.
            store = self.trainer.store
            on_disk = policy == OFFLOAD and store is not None and store.nvme is not None
            self.activations = apply_activation_policy(unwrap_peft(self.model), policy,
                                                       store=store if on_disk else None,
                                                       keep_last=self.cfg.activations_keep_last,
                                                       compress=self.cfg.activations_compress)

    def _restore(self) -> None:
        """Continue from the newest checkpoint that verifies, saying which newer ones were skipped."""
        last, (model_state, optim_state, trainer), skipped = ckpt.load_newest_valid(self.out)
        for why in skipped:  # before the dashboard starts: a plain line on stderr
            print(f"outcore: warning: {why}; resuming from {last.name} instead", file=sys.stderr)
        if self.units_in_store:
            restore_units(self.trainer, last)
        else:  # the single-process format, or DCP's (from any number of ranks)
            restore_trainable(last, model_state, optim_state, self.model, self.optimizer)
        # (checkpoints before the one training loop also hold a "scheduler" state: the
        # learning rate is a function of the step, so it is not needed)
        dist.restore_loader(self.loader, trainer, self.cfg, self.ranks)  # grad_accum × ranks kept
        ckpt.set_rng_state(trainer["rng"], self.device)
        self.step = trainer["step"]
        self.base_eval_loss = trainer["base_eval_loss"]
        self._saved = (self.step, 0.0)  # a checkpoint of this step exists (its age unknown: old)

    # ------------------------------------------------------------------ train
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token loss of ``model`` (the run's) over the batch's labelled tokens.

        The head goes through ``CausalLMHeadLoss``: the loss without the
        [tokens, vocab] logits (at vocab 49152 they are the largest activation).
        """
        return self.scorer.loss(batch)  # ``model`` is the scorer's: the run's model

    def train(self) -> None:
        """Run the optimizer steps up to ``max_steps``, evaluating, logging and checkpointing.

        Raises:
            FloatingPointError: the loss became NaN or infinite.
        """
        cfg = self.cfg
        self._emit_started()
        if self.base_eval_loss is None:
            self.base_eval_loss = self._eval(step=0)
        self.losses: list[float] = []
        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.ranks.world
        t_start = time.perf_counter()
        while self.step < cfg.max_steps:
            dist.check_stop(self.stop, self.ranks)  # a signal during the last step: stop here, the step whole
            t0, stall0 = time.perf_counter(), self.trainer.stall_s
            lr = cfg.lr * self.lr_at(self.step)  # linear warmup, then cosine decay
            # forward, backward and the update (out of core: every unit's, streamed through the tiers)
            micro = dist.my_micro_batches(self.loader, cfg.grad_accum, self.ranks)
            loss_sum = self.trainer.train_step(self.loss, micro, lr)
            self.step += 1
            step_s = time.perf_counter() - t0  # before any eval: tokens/s is training speed

            eval_loss = None
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                eval_loss = self._eval(self.step)
            if self.step % cfg.log_every == 0 or self.step == cfg.max_steps or eval_loss is not None:
                loss_value = float(loss_sum)  # host sync: only at log steps
                self.losses.append(loss_value)
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss became {loss_value} at step {self.step}; "
                                             "lower --lr or use dtype=float32")
                grad_norm = self.trainer.last_grad_norm
                self.sink.emit(dist.with_ranks(self.ranks, self.wear.fill(StepEvent(
                    step=self.step, total_steps=cfg.max_steps, loss=loss_value, lr=lr,
                    tokens_per_s=tokens_per_step / step_s, step_s=step_s,
                    elapsed_s=time.perf_counter() - t_start, rss_bytes=rss_bytes(),
                    ram_bytes=ram_total_bytes(), grad_norm=None if grad_norm is None else float(grad_norm),
                    eval_loss=eval_loss, stall_s=self.trainer.stall_s - stall0,
                    tiers=self.trainer.tier_stats(), **device_memory(self.device))), str(self.out)))
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                self.save()
        dist.check_stop(self.stop, self.ranks)

    def _emit_started(self) -> None:
        cfg = self.cfg
        n_trainable = sum(p.numel() for p in self.params)
        n_params = sum(p.numel() for p in self.model.parameters())
        if self.streamed:  # streamed parameters point at empty tensors: count the units
            n_params = sum(s.numel for u in self.trainer.units for s in u.slots)
            n_params += n_trainable if self.lora else 0  # the resident adapters
            n_trainable = n_trainable if self.lora else n_params
        self.wear = WearMeter(self.trainer.store, cfg.ssd_tbw, swap_dir_of(cfg, self.out), self.out, self.step)
        self.sink.emit(RunStarted(run_name=self.out.name, model=cfg.model, n_params=n_params,
                                  n_trainable=n_trainable, total_steps=cfg.max_steps, output_dir=str(self.out),
                                  method=cfg.method, optim=cfg.optim, config=cfg.to_dict(),
                                  plan_table=None if self.plan is None else self.plan.table()))

    def _eval(self, step: int) -> float:
        self.model.eval()
        fault_point("eval")
        loss = mean_eval_loss(lambda batch: self.loss(self.model, batch), self.val_set, self.cfg.batch_size,
                              self.cfg.eval_batches)
        task = None if self.task is None else score_task(self.scorer, self.tokenizer, self.task,
                                                         self.cfg.batch_size * self.cfg.seq_len)
        self.model.train()
        self.sink.emit(EvalEvent(step=step, eval_loss=loss, perplexity=perplexity(loss)))
        if task is not None:
            self.sink.emit(TaskEvalEvent(step=step, task=task.task, n=task.n, acc=task.acc, acc_norm=task.acc_norm))
        return loss

    def save(self) -> Path:
        """Checkpoint everything needed to continue bit-identically."""
        trainer_state = {"step": self.step, "loader": self.loader.state_dict(), "rng": ckpt.rng_state(self.device),
                         "base_eval_loss": self.base_eval_loss, "micro_batches": dist.step_size(self.cfg, self.ranks)}
        keep = self.cfg.keep_checkpoints
        if self.ranks.distributed:  # every rank writes its share (torch.distributed.checkpoint)
            path = save_distributed(self.out, self.step, self.model, self.optimizer, trainer_state, keep, self.ranks,
                                    engine=self.trainer if self.units_in_store else None)
        elif self.units_in_store:  # streamed out of the store, unit by unit
            path = ckpt.save_checkpoint(self.out, self.step, {}, {}, trainer_state, keep=keep,
                                        write_extra=lambda d: ckpt.save_units(self.trainer, d / "units"),
                                        extra_bytes=ckpt.units_bytes(self.trainer))
        else:
            path = ckpt.save_checkpoint(self.out, self.step, ckpt.trainable_state(self.model),
                                        self.optimizer.state_dict(), trainer_state, keep=keep)
        self._saved = (self.step, time.monotonic())
        return path

    # ---------------------------------------------------------------- cleanup
    def cleanup(self, interrupted: bool = False) -> FinetuneResult:
        """Evaluate, checkpoint and export (unless ``interrupted``), release memory, report the end.

        Returns:
            The run's FinetuneResult.
        """
        final_eval = final_dir = None
        if not interrupted:
            final_eval = self._eval(self.step)
            self.save()
            if self.cfg.export and self.ranks.is_main:  # the replicas are equal: rank 0 exports
                final_dir = self._export(self.out / "final")
        self._release_memory()
        self.sink.emit(self.wear.fill(RunFinished(
            steps_done=self.step, wall_s=time.perf_counter() - self._t0, peak_rss_bytes=peak_rss_bytes(),
            output_dir=str(self.out), base_eval_loss=self.base_eval_loss, final_eval_loss=final_eval,
            interrupted=interrupted, final_dir=None if final_dir is None else str(final_dir))))
        self.sink.close()
        self._reported = True
        return FinetuneResult(self.out, self.step, final_dir, self.base_eval_loss, final_eval,
                              getattr(self, "losses", []), interrupted)

    def _export(self, out_dir: Path) -> Path:
        """The trained model as a Hugging Face directory (streamed out of the store out of core)."""
        if self.streamed:
            return export_offloaded(self.trainer, self.model, out_dir, self.tokenizer)
        return export_hf(self.model, self.tokenizer, out_dir)

    def run(self) -> FinetuneResult:
        """setup → train → cleanup. SIGINT / SIGTERM stop the run at the end of its step with a
        checkpoint (see :meth:`_stopped`); a bare Ctrl-C (no handler: not the main thread)
        keeps the last checkpoint as it is. Either is reported as interrupted and re-raised.

        Returns:
            The run's FinetuneResult.
        """
        self._t0, self._saved, self._reported = time.perf_counter(), (0, 0.0), False
        with StopOnSignal() as self.stop, holding_output_dir(self), dist.leaving_group(self):
            try:
                self.setup()
                self.stop.deferring = True  # signals wait for the end of the step
                try:
                    self.train()
                except KeyboardInterrupt as e:
                    self.stop.deferring = False
                    self._stopped(e)
                    raise
                self.stop.deferring = False
                return self.cleanup()
            except BaseException:
                if not self._reported:  # e.g. a bad model after the store was made: remove its swap dir
                    self._abort()
                raise

    def _stopped(self, stop: KeyboardInterrupt) -> None:
        """Checkpoint a run stopped between steps (unless its newest checkpoint is seconds old),
        then report it interrupted. A bare KeyboardInterrupt may have cut a step in half: no save."""
        if isinstance(stop, Interrupted):
            step, at = self._saved
            if self.step > step and time.monotonic() - at >= RECENT_CHECKPOINT_S:
                self.save()
            stop.step = self._saved[0]
            stop.output = str(self.out) if stop.step else None  # no checkpoint: nothing to resume
        self.cleanup(interrupted=True)

    def _abort(self) -> None:
        """Release what setup built and close the sink, reporting nothing more (a failed run)."""
        self._release_memory()
        self.sink.close()

    def _release_memory(self) -> None:
        """Stop the activation offload threads, then finish the store's writes and remove
        the swap directory (the offloader keeps its bytes in that store)."""
        if getattr(self, "activations", None) is not None:
            self.activations.remove()
            self.activations = None
        if getattr(self, "trainer", None) is not None:
            self.trainer.close()


def finetune(config: FinetuneConfig, sink: EventSink | None = None) -> FinetuneResult:
    """Fine-tune as ``config`` says (``method`` full, lora or qlora).

    The Python API is ``outcore.finetune`` (config overrides, and a dashboard or plain
    log by default); this is the recipe it runs.

    Args:
        config: the run's config.
        sink: where events go (default: none reported).

    Returns:
        A FinetuneResult (output dir, steps, eval losses, final export dir).

    Raises:
        OutcoreError: bad config, model, data or checkpoint (one-line message).
    """
    return Recipe(config, sink).run()
