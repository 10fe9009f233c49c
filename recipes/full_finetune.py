"""Full, LoRA or QLoRA fine-tuning of a causal LM: the readable reference recipe.

Read it top to bottom: ``setup`` builds the model (in memory or streamed), the data, the loss
and the trainer from the run's config, and restores the newest checkpoint to resume; ``step``
is one optimizer step; ``evaluate``, ``save`` and ``export`` do what they say; ``close``
releases what setup built. Everything around them — the output directory, signals, ranks,
events, the eval and checkpoint cadences — is the run's (``training/lifecycle.py``).

The model trains behind one interface, ``Trainer.train_step(loss_fn, micro_batches, lr)``
(``training/trainer.py``): an ``InMemoryModel`` (the numerical reference every out-of-core
mode is checked against: same seed + fp32 ⇒ same weights, bit for bit) or an
``OutOfCoreEngine`` whose weights and optimizer state stream through the tiers.

The run receives its event sink; with none it reports nothing (``outcore.finetune`` and
``outcore finetune`` give it the dashboard or plain log and ``metrics.jsonl``).
"""
from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from .._faults import fault_point
from ..activations.policy import OFFLOAD, ActivationPolicy, activation_home
from ..dtypes import torch_dtype
from ..errors import ConfigError
from ..events import EventSink, TaskEvalEvent
from ..methods import objective
from ..training import checkpoint as ckpt
from ..training import distributed as dist
from ..training.build import (check_offload_supported, offload_from_plan, optimizer_for_config, plan_this_run,
                              swap_dir_of, with_lora)
from ..training.config import FinetuneConfig
from ..training.checkpoint.dcp import restore_trainable, restore_units, save_distributed
from ..training.in_memory import InMemoryModel
from ..training.lifecycle import Built, Evaluation, Run, Stepped
from ..training.loss import CausalLMScorer
from ..training.loss import mean_eval_loss
from ..training.runs import FinetuneResult
from ..training.trainer import Trainer
from .evaluate import score_task
from .export import export_hf, export_offloaded

if TYPE_CHECKING:  # pragma: no cover
    from ..offload.engine import OutOfCoreEngine
    from ..planner import MemoryPlan


class FullFinetune:
    """Fine-tune every weight (``method=full``) or LoRA adapters beside a frozen, optionally
    NF4-quantized base (``lora``, ``qlora``), in memory or out of core.

    Args:
        run: the run it is part of (its config, ranks, device and output directory).

    Raises:
        ConfigError: ``method="zo"`` (the ZO recipe runs it); an unreadable ``eval_task``.
    """

    def __init__(self, run: Run) -> None:
        from ..data.tasks import load_task

        if run.cfg.zeroth_order:
            raise ConfigError("method='zo' runs in recipes.zo_finetune; call outcore.finetune, which picks the recipe")
        self.run, self.cfg = run, run.cfg
        self.task = load_task(self.cfg.eval_task) if self.cfg.eval_task else None  # a bad file fails before any work
        self.plan: MemoryPlan | None = None  # out of core: where every tensor lives
        self.engine: OutOfCoreEngine | None = None  # the model streamed through the tiers (None: in memory)
        self._resources = ExitStack()  # what setup built that holds memory, threads or a swap dir

    # ------------------------------------------------------------------ setup
    def setup(self) -> Built:
        """Build the model (in memory, or streamed), the data, the loss and the trainer; resume.

        Raises:
            OutcoreError: bad config, model, data or checkpoint.
        """
        from ..data import BatchLoader, check_seq_len
        from ..models import check_packed_documents, load_model, load_model_lazily

        cfg, run = self.cfg, self.run
        torch.manual_seed(cfg.seed)
        fill = None
        if cfg.offload != "none":
            # Out of core, the weights go straight from their files into the store,
            # unit by unit: the model is built on the meta device, never whole in RAM.
            check_offload_supported(cfg)
            self.model, self.tokenizer, fill = load_model_lazily(cfg.model, dtype=torch_dtype(cfg.dtype))
            self.plan = plan_this_run(cfg, self.model)
            if self.plan.layout == "none":  # `auto` found that everything fits in memory
                self.plan.notes.append("everything fits in memory: training in memory")
                fill = None
        if fill is None:
            self.model, self.tokenizer = load_model(cfg.model, dtype=torch_dtype(cfg.dtype),
                                                    quantize_4bit=cfg.quantizes_base)
        check_seq_len(self.model, cfg.seq_len)
        if cfg.padding_free:  # a packed row's documents kept apart, or one line
            check_packed_documents(self.model)
        if cfg.uses_adapters:
            self.model = with_lora(self.model, cfg)
        if fill is None:  # in memory: the whole model on the compute device (out of core the engine places it)
            self.model.to(run.device)
        self.model.train()
        # The KV cache is for generation; in training it only costs memory.
        self.model.config.use_cache = False

        self.train_set, self.val_set = self._datasets()
        self.loader = BatchLoader(self.train_set, cfg.batch_size, seed=cfg.seed)
        self.scorer = CausalLMScorer(self.model, run.device)  # the loss, and the task's log-likelihoods
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainer = self._trainer(fill)
        self._resources.callback(self.trainer.close)
        self._activations()
        self._prepare()
        step, base_eval_loss = self._restore() if cfg.resume else (None, None)
        n_params, n_trainable = self._sizes()
        rows = cfg.batch_size * objective(cfg.objective).rows_per_example  # (a preference pair is two rows)
        tokens_per_step = rows * cfg.seq_len * dist.step_size(cfg, run.ranks)  # (over every rank)
        return Built(n_params, n_trainable, tokens_per_step,
                     store=None if self.engine is None else self.engine.store, swap_dir=swap_dir_of(cfg, run.out),
                     plan_table=None if self.plan is None else self.plan.table(),
                     activations=activation_home(self._activation_policy()),
                     checkpoint_step=step, base_eval_loss=base_eval_loss)

    def _datasets(self) -> tuple[Any, Any]:
        """``(train, val)``: the run's data as fixed-length token rows (next-token loss)."""
        from ..data import build_datasets

        cfg = self.cfg
        return build_datasets(cfg.data, self.tokenizer, cfg.seq_len, seed=cfg.seed, val_fraction=cfg.val_fraction,
                              max_bytes=cfg.data_max_bytes, padding_free=cfg.padding_free)

    def _prepare(self) -> None:
        """What the data needs of the model before training or resuming: nothing for the
        next-token loss (a preference objective's reference log-probabilities)."""

    def _trainer(self, fill: Callable[[str, torch.Tensor], None] | None) -> Trainer:
        """The optimizer, and the model behind ``train_step``: in memory, or streamed when
        the model was built on the meta device (``fill`` reads its weights)."""
        cfg, run = self.cfg, self.run
        if fill is None:
            self.optimizer = optimizer_for_config(cfg, self.params)
            return InMemoryModel(self.model, self.optimizer, self.params, cfg.max_grad_norm, run.ranks, str(run.out))
        # Full fine-tune: the optimizer streams its state with the units. LoRA: the
        # adapters and their state stay resident; only the frozen base streams.
        self.optimizer = optimizer_for_config(cfg, self.params, streaming=not cfg.uses_adapters)
        self.engine = offload_from_plan(cfg, self.model, self.optimizer, self.plan, run.out, self.scorer.head_loss,
                                        fill, run.ranks, run.device)  # (the head's loss is a unit of the head)
        return dist.data_parallel(self.engine, run.ranks, str(run.out))  # LoRA under torchrun

    def _activation_policy(self) -> str:
        """The run-level activation policy: the plan's (it resolves ``auto``), else the config's."""
        return self.plan.activations if self.plan is not None else self.cfg.activations

    def _activations(self) -> None:
        """What each block keeps for its backward: the plan resolves `auto` when there is one."""
        from ..activations import apply_activation_policy
        from ..activations.tiling import tile_of
        from ..models import unwrap_peft

        policy = self._activation_policy()
        tile = tile_of(unwrap_peft(self.model), self.cfg.seq_tile)
        rows = self.cfg.seq_len * self.cfg.batch_size * objective(self.cfg.objective).rows_per_example
        tile = tile if 0 < tile < rows else 0  # (a micro-batch of one tile runs untiled anyway)
        if policy == ActivationPolicy.KEEP.value and not tile:
            return

        # Offloaded activations go to the run's store: its swap dir (the disk the user
        # chose) and its traffic counters, not a private store in the temp dir.
        store = None if self.engine is None else self.engine.store
        to_disk = policy in (OFFLOAD, ActivationPolicy.RECOMPUTE_NVME.value)
        on_disk = to_disk and store is not None and store.has_tier("nvme")
        # block checkpoints on HOST: a private store's HOST tier sized by the plan
        host = self.plan.tier_bytes["HOST"].get("activations", 0) if self.plan is not None else 0
        # read ahead as deep as the plan counts (its prefetch depth: the checkpoints it holds near)
        depth = {} if self.plan is None else {"prefetch_depth": self.plan.activations_read_ahead}
        hooks = apply_activation_policy(unwrap_peft(self.model), policy, store=store if on_disk else None,
                                        **depth, keep_last=self.cfg.activations_keep_last,
                                        compress=self.cfg.activations_compress, seq_tile=tile,
                                        host_budget=max(host, 1 << 30))
        # (closed first: its offload threads stop before the store they write to closes)
        self._resources.callback(hooks.remove)

    def _sizes(self) -> tuple[int, int]:
        """``(parameters, trainable parameters)`` of the model."""
        n_trainable = sum(p.numel() for p in self.params)
        if self.engine is None:
            return sum(p.numel() for p in self.model.parameters()), n_trainable
        streamed = sum(s.numel for u in self.engine.units for s in u.slots)  # (the parameters are empty)
        if self.cfg.uses_adapters:  # the resident adapters beside the streamed base
            return streamed + n_trainable, n_trainable
        return streamed, streamed

    @property
    def _state_in_store(self) -> OutOfCoreEngine | None:
        """The engine, when the weights and optimizer state live in its store (a full fine-tune out
        of core: checkpointed unit by unit from there); None when the model and optimizer hold them."""
        return None if self.cfg.uses_adapters else self.engine

    def _restore(self) -> tuple[int, float | None]:
        """Continue from the newest checkpoint that verifies, saying which newer ones were skipped.

        Returns:
            ``(step, base eval loss)`` of the checkpoint.
        """
        last, (model_state, optim_state, trainer), skipped = ckpt.load_newest_valid(self.run.out)
        for why in skipped:  # before the dashboard starts: a plain line on stderr
            print(f"outcore: warning: {why}; resuming from {last.name} instead", file=sys.stderr)
        engine = self._state_in_store
        if engine is not None:
            restore_units(engine, last)
        else:  # the single-process format, or DCP's (from any number of ranks)
            restore_trainable(last, model_state, optim_state, self.model, self.optimizer)
        # (checkpoints before the one training loop also hold a "scheduler" state: the
        # learning rate is a function of the step, so it is not needed)
        dist.restore_loader(self.loader, trainer, self.cfg, self.run.ranks)  # grad_accum × ranks kept
        ckpt.set_rng_state(trainer["rng"], self.run.device)
        return trainer["step"], trainer["base_eval_loss"]

    # ------------------------------------------------------------------ train
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token loss of ``model`` (the run's) over the batch's labelled tokens.

        The head goes through ``CausalLMHeadLoss``: the loss without the
        [tokens, vocab] logits (at vocab 49152 they are the largest activation).
        """
        return self.scorer.loss(batch)  # ``model`` is the scorer's: the run's model

    def step(self, lr: float) -> Stepped:
        """One optimizer step: forward, backward and the update (out of core: every unit's,
        streamed through the tiers) over this rank's micro-batches of the step."""
        micro = dist.my_micro_batches(self.loader, self.cfg.grad_accum, self.run.ranks)
        loss = self.trainer.train_step(self.loss, micro, lr)
        return Stepped(loss, grad_norm=self.trainer.last_grad_norm)

    def evaluate(self, step: int) -> Evaluation:
        """The held-out loss, and the eval task's accuracy when there is one."""
        self.model.eval()
        fault_point("eval")
        loss = mean_eval_loss(lambda batch: self.loss(self.model, batch), self.val_set, self.cfg.batch_size,
                         self.cfg.eval_batches)
        task = None if self.task is None else score_task(self.scorer, self.tokenizer, self.task,
                                                         self.cfg.batch_size * self.cfg.seq_len)
        self.model.train()
        if task is None:
            return Evaluation(loss)
        return Evaluation(loss, TaskEvalEvent(step=step, task=task.task, n=task.n, acc=task.acc,
                                              acc_norm=task.acc_norm))

    def save(self) -> None:
        """Checkpoint everything needed to continue bit-identically."""
        run, keep, engine = self.run, self.cfg.keep_checkpoints, self._state_in_store
        trainer_state = {"step": run.step, "loader": self.loader.state_dict(), "rng": ckpt.rng_state(run.device),
                         "base_eval_loss": run.base_eval_loss, "micro_batches": dist.step_size(self.cfg, run.ranks)}
        if run.ranks.distributed:  # every rank writes its share (torch.distributed.checkpoint)
            save_distributed(run.out, run.step, self.model, self.optimizer, trainer_state, keep, run.ranks,
                             engine=engine)
        elif engine is not None:  # streamed out of the store, unit by unit
            ckpt.save_checkpoint(run.out, run.step, {}, {}, trainer_state, keep=keep,
                                 write_extra=lambda d: ckpt.save_units(engine, d / "units"),
                                 extra_bytes=ckpt.units_bytes(engine))
        else:
            ckpt.save_checkpoint(run.out, run.step, ckpt.trainable_state(self.model), self.optimizer.state_dict(),
                                 trainer_state, keep=keep)

    # ---------------------------------------------------------------- the end
    def export(self, out_dir: Path) -> Path:
        """The trained model as a Hugging Face directory (streamed out of the store out of core)."""
        if self.engine is not None:
            return export_offloaded(self.engine, self.model, out_dir, self.tokenizer)
        return export_hf(self.model, self.tokenizer, out_dir)

    def close(self, completed: bool) -> None:
        """Stop the activation offload threads, then finish the store's writes and remove the
        swap directory (the offloader keeps its bytes in that store)."""
        self._resources.close()


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
    return Run(config, sink).execute(FullFinetune)
