"""Train out of core from a ``transformers.Trainer`` script by changing one line.

::

    trainer = OutOfCoreTrainer(model=model, args=args, train_dataset=ds)      # was: Trainer(...)
    trainer = out_of_core(SFTTrainer)(model=model, args=args, train_dataset=ds)  # TRL

The Trainer keeps its loop, its data, its scheduler, its logging, its callbacks and its
checkpoint folders. What changes sits under four of its methods:

* ``create_optimizer`` builds outcore's AdamW (or takes the ``outcore.optim`` optimizer passed
  through ``optimizers=``) and hands the model to :func:`~outcore.offload.engine.assemble.offload_model`:
  weights and optimizer state move to the tiers and stream through the engine's hooks. The
  Trainer gets an :class:`EngineOptimizer` whose ``param_groups`` its scheduler drives.
* ``training_step`` runs the Trainer's own forward and backward inside the engine's micro-batch
  (docs/architecture.md §5): without clipping or accumulation each unit updates in the
  backward (step-in-backward), else after it.
* ``_clip_grad_norm`` is the engine's global-norm clip; ``optimizer.step()`` ends the step.
* ``_save`` / ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` write and
  read the model (a Hugging Face directory, streamed one unit at a time) and the units'
  weights and state (``outcore-units/``, training/checkpoint/run_state.py's ``save_units``).

TRL's ``DPOTrainer`` and ``KTOTrainer`` with ``precompute_ref_log_probs=True`` work the same
way: the reference's log-probabilities are computed by the streamed model before the first step,
so no second model is held. TRL's ``GRPOTrainer`` (transformers' generation, ``beta=0`` or a peft
model: no second model either) samples its completions with ``model.generate`` through the
engine's hooks.

TRL's trainers compute log-probabilities with a fused head that reads ``lm_head.weight`` without
calling ``lm_head``: the engine ends the head unit when the model's forward returns
(``OutOfCoreEngine._model_forward_end``), so the head leaves memory as after any forward.

A peft model (LoRA; TRL's ``peft_config=``) streams only its frozen base: its adapters stay
resident and the Trainer's own optimizer, clipping and adapter-only saving serve them as usual.

Which ``TrainingArguments`` are honoured and which refused: ``trainer_args.py``.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from transformers import Trainer
from transformers.trainer import _is_peft_model

from ..errors import ConfigError
from ..offload.modes import CPU, STREAMED_MODES
from ..optim import AdamW
from ..optim._base import OutcoreOptimizer
from .trainer_args import check_training_args

if TYPE_CHECKING:  # pragma: no cover
    from ..offload.engine import OutOfCoreEngine

#: the folder of a Trainer checkpoint that holds each unit's weights and optimizer state
UNITS_DIR = "outcore-units"


class EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer sees as its optimizer: the engine's step, behind torch's interface.

    ``param_groups`` are the Trainer's to drive (its scheduler sets ``lr``); each step reads the
    learning rate from them when it begins. The state lives in the engine's tiers, not in
    ``self.state`` (saved by the Trainer's ``_save_optimizer_and_scheduler``, see
    :class:`OutOfCoreMixin`).

    Args:
        engine: the ``OutOfCoreEngine`` training the model.
    """

    def __init__(self, engine: OutOfCoreEngine):
        super().__init__([dict(g) for g in engine.optimizer.param_groups], {})
        self.engine = engine
        self._open = False  # a step has begun and not ended

    @contextlib.contextmanager
    def micro_batch(self, n_micro: int) -> Iterator[None]:
        """Run one micro-batch's forward and backward inside; the first of a step begins it.

        Args:
            n_micro: micro-batches in this step (the Trainer's ``current_gradient_accumulation_steps``).
        """
        if not self._open:
            self.engine.begin_step(self.param_groups[0]["lr"], n_micro)
            self._open = True
        with self.engine.micro_batch():
            yield

    def clip(self) -> torch.Tensor | None:
        """The engine's global-norm clip of this step's gradients; returns the norm."""
        return self.engine.clip()

    def state_dict(self) -> dict[str, Any]:
        """Resident adapters: their optimizer's state (what the Trainer saves as optimizer.pt); a
        streamed model's state is in the tiers (``UNITS_DIR``), and this holds only the groups."""
        if not self.engine.resident:
            return super().state_dict()
        state = self.engine.optimizer.state_dict()
        for saved, group in zip(state["param_groups"], self.param_groups):  # the scheduler's lr is in ours
            saved.update({k: v for k, v in group.items() if k != "params"})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict`."""
        if not self.engine.resident:
            super().load_state_dict(state_dict)
            return
        self.engine.optimizer.load_state_dict(state_dict)
        # the groups' hyper-parameters too: the learning rate of the next step is read from them
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """End the step: the updates that waited for the backward (none with step-in-backward)."""
        if closure is not None:
            raise ConfigError("optimizer.step(closure): the out-of-core step runs forward and backward "
                              "in training_step; call step() without a closure")
        if self._open:
            self.engine.end_step()
            self._open = False


class OutOfCoreMixin:
    """Put before a ``transformers.Trainer`` subclass to train it out of core (see :func:`out_of_core`).

    Args:
        offload: ``cpu`` (weights and state in RAM, streamed through the device window) or
            ``nvme`` (on disk, in ``swap_dir``).
        swap_dir: the swap directory for ``nvme`` (created 0700, removed by :meth:`close`).
        prefetch: units fetched ahead (k).
        *args, **kwargs: the Trainer's own.

    Raises:
        ConfigError: an ``offload`` the engine does not stream, or a refused training argument
            (``trainer_args.py``).
    """

    def __init__(self, *args: Any, offload: str = CPU, swap_dir: str | os.PathLike | None = None,
                 prefetch: int = 2, **kwargs: Any):
        if offload not in STREAMED_MODES:
            raise ConfigError(f"offload={offload!r}: the out-of-core Trainer streams from "
                              f"{' or '.join(STREAMED_MODES)}; for in-memory training use the plain Trainer")
        super().__init__(*args, **kwargs)
        self.adapters = _is_peft_model(self.model)  # (TRL applies peft_config in its __init__)
        check_training_args(self.args, adapters=self.adapters)
        if not self.adapters:  # (a peft model's resident adapters are the Trainer's own optimizer's)
            self._check_streamed_optimizer()
        self._offload = dict(offload=offload, swap_dir=swap_dir, prefetch=prefetch)
        self.engine: OutOfCoreEngine | None = None  # built with the optimizer, when training starts

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing: the engine places the model (its units stream; the rest goes to the device
        when the engine is built). The Trainer's own move would put all of it in GPU memory."""

    def _check_streamed_optimizer(self) -> None:
        """A streamed model updates through an ``outcore.optim`` optimizer (its state lives in the tiers)."""
        if self.optimizer is not None and not isinstance(self.optimizer, OutcoreOptimizer):
            raise ConfigError(f"optimizers=({type(self.optimizer).__name__}, ...): the out-of-core engine "
                              "updates through an outcore.optim optimizer (e.g. outcore.optim.AdamW)")
        if self.optimizer_cls_and_kwargs is not None:
            raise ConfigError("optimizer_cls_and_kwargs: pass optimizers=(outcore.optim.<Name>(...), None) instead")

    # ------------------------------------------------------------ the optimizer is the engine
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Build the engine over ``self.model`` (once) and return the optimizer the Trainer steps."""
        if self.engine is not None:
            return self.optimizer
        from ..offload.engine import offload_model

        if self.adapters:
            # the Trainer's own optimizer over the adapters (its weight-decay groups), and its own
            # clip of their gradients (_clip_grad_norm): the engine only streams the frozen base
            inner, clip = super().create_optimizer(model), 0.0
        else:
            inner = self.optimizer if isinstance(self.optimizer, OutcoreOptimizer) else self._adamw()
            clip = self.args.max_grad_norm
        # on the Trainer's device, where it puts the batches
        self.engine = offload_model(self.model, inner, max_grad_norm=clip, resident_trainable=self.adapters,
                                    grad_accum=self.args.gradient_accumulation_steps, device=self.args.device,
                                    **self._offload)
        # closed once: by close(), or when the Trainer is collected (or at exit): the swap dir goes with it
        self._close_engine = weakref.finalize(self, self.engine.close)
        self.optimizer = EngineOptimizer(self.engine)
        return self.optimizer

    def _adamw(self) -> AdamW:
        """The Trainer's AdamW (its ``learning_rate``, betas, epsilon) over the trainable parameters."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return AdamW(params, lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                     eps=self.args.adam_epsilon, weight_decay=0.0)

    def _engine_optimizer(self) -> EngineOptimizer:
        # accelerate wraps the optimizer (AcceleratedOptimizer); the engine's is inside
        return getattr(self.optimizer, "optimizer", self.optimizer)

    # ---------------------------------------------------------------------- the step
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's forward and backward, inside the engine's micro-batch."""
        with self._engine_optimizer().micro_batch(self.current_gradient_accumulation_steps):
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: Any) -> torch.Tensor | None:
        if self.adapters:  # resident gradients: the Trainer's own clip
            return super()._clip_grad_norm(model)
        return self._engine_optimizer().clip()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if self.adapters:
            return super()._get_grad_norm(model, grad_norm)
        # without clipping no norm is taken: the gradients left memory as each unit updated
        return grad_norm

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write the trained model as a Hugging Face directory, one unit at a time (adapters:
        the Trainer's own adapter-only save)."""
        if self.engine is None or self.adapters:
            return super()._save(output_dir, state_dict)
        from transformers.trainer import TRAINING_ARGS_NAME

        from ..recipes.export import export_offloaded

        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        # staged beside, then moved in: the export replaces its whole directory, and output_dir
        # may hold checkpoint folders
        staged = export_offloaded(self.engine, self.model, out / ".outcore-export", tokenizer=self.processing_class)
        for f in staged.iterdir():
            os.replace(f, out / f.name)
        staged.rmdir()
        torch.save(self.args, out / TRAINING_ARGS_NAME)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.engine is not None and not self.adapters:  # (a frozen base never changes)
            from ..training.checkpoint.run_state import save_units

            save_units(self.engine, Path(output_dir) / UNITS_DIR)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.engine is not None and not self.adapters:
            from ..training.checkpoint.run_state import load_units

            units = Path(checkpoint) / UNITS_DIR
            if not units.is_dir():
                raise ConfigError(f"resume_from_checkpoint={checkpoint!r} has no {UNITS_DIR}/: it was not "
                                  "saved by an out-of-core Trainer (or with save_only_model=True)")
            load_units(self.engine, units)

    def close(self) -> None:
        """Finish every write, free the tiers and remove the swap directory (the model's weights
        then live only in what ``save_model`` wrote)."""
        if self.engine is not None:
            self._close_engine()


def out_of_core(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``SFTTrainer``), out of core.

    Args:
        trainer_cls: the Trainer class the script uses.

    Returns:
        A subclass taking the same arguments plus ``offload``, ``swap_dir`` and ``prefetch``
        (see :class:`OutOfCoreMixin`).

    Raises:
        ConfigError: ``trainer_cls`` is not a ``transformers.Trainer``.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ConfigError(f"out_of_core({trainer_cls!r}): pass a transformers.Trainer class (or a subclass)")
    return type(f"OutOfCore{trainer_cls.__name__}", (OutOfCoreMixin, trainer_cls), {"__module__": __name__})


OutOfCoreTrainer = out_of_core(Trainer)
