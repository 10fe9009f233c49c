"""One run's lifecycle, the same for every training method: ``Run(config, sink).execute(RecipeClass)``.

A recipe (:class:`Recipe`) says what differs between methods — how its model, data and
trainer are built, what one step, an eval, a checkpoint and the export are. :class:`Run` owns
everything around them, in this order:

1. the recipe is constructed (its own checks of the config, before any work);
2. :meth:`Run.open` joins the process group (torchrun), picks this rank's device and threads,
   and creates (or, to resume, checks) the output directory, holding its lock (rank 0);
3. ``recipe.setup()`` builds the model, data and trainer and restores the newest checkpoint;
4. the steps, while a SIGINT / SIGTERM waits for the end of the step it comes in
   (``StopOnSignal``, agreed by every rank): ``RunStarted``, the base eval, then per step its
   learning rate (:func:`lr_lambda`: linear warmup, then cosine decay), log line, the eval and
   checkpoint cadences;
5. the end: the final eval, a checkpoint and (rank 0) the export, ``recipe.close``, ``RunFinished``.

A signal between steps writes a checkpoint unless the newest one is younger than
:data:`RECENT_CHECKPOINT_S`, reports the run interrupted (``Interrupted.step`` / ``.output``)
and re-raises. A failure anywhere closes what the recipe built (its store removes the swap
directory) and the sink, and reports nothing more. However the run ends, the output
directory's lock is released and the process group left (not after a lost rank).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from ..errors import Interrupted, RankLostError
from ..events import (EvalEvent, EventSink, GRPOStepEvent, NullSink, PreferenceEvalEvent, RewardEvalEvent,
                      RunFinished, RunStarted, StepEvent, TaskEvalEvent, perplexity)
from ..offload.device import resolve_device
from ..offload.device import device_memory
from ..offload.distributed import Ranks
from .distributed import across_ranks as dist
from .config import FinetuneConfig
from .output_dir import holding_output_dir
from .process import peak_rss_bytes, ram_total_bytes, rss_bytes, set_threads
from .runs import FinetuneResult
from .signals import StopOnSignal
from .wear import WearMeter

if TYPE_CHECKING:  # pragma: no cover
    from ..offload.store import TieredStore

# A run stopped by a signal writes a checkpoint unless its newest one is younger than
# this: a few seconds of steps are cheaper to redo than a large model's checkpoint to write.
RECENT_CHECKPOINT_S = 10.0


@dataclass(frozen=True)
class Built:
    """What a recipe's setup built, as the run reports it and continues from it."""

    n_params: int
    n_trainable: int
    tokens_per_step: int  # the tokens one optimizer step trains on, over every rank
    store: TieredStore | None = None  # the store the weights stream through (None: nothing streams)
    swap_dir: Path | None = None  # the store's swap directory (None: OUTPUT/swap), for the wear figures
    plan_table: str | None = None  # the memory plan, as ``outcore plan`` prints it
    activations: str = ""  # where the saved activations live (activations.policy.activation_home)
    #: the step of the checkpoint the run continues from, or that it already is (ZO: its log,
    #: of step 0 for a new run); None: no checkpoint yet (a new first-order run)
    checkpoint_step: int | None = None
    base_eval_loss: float | None = None  # the resumed run's base eval (None: evaluate now)


@dataclass(frozen=True)
class Stepped:
    """One step's outcome."""

    loss: torch.Tensor | float  # a tensor is read (a host sync) at log steps only
    grad_norm: torch.Tensor | None = None  # before clipping (None: not computed)
    checkpointed: bool = False  # the step is a checkpoint already (ZO: its log line)
    rollouts: GRPOStepEvent | None = None  # GRPO: its completions' rewards and timings, logged after the step


@dataclass(frozen=True)
class Evaluation:
    """One validation pass."""

    loss: float  # the held-out loss
    task: TaskEvalEvent | None = None  # the eval task's score, reported after the loss
    preference: PreferenceEvalEvent | None = None  # a preference objective's held-out accuracy and margin
    reward: RewardEvalEvent | None = None  # GRPO: the held-out prompts' mean reward


class Recipe(Protocol):
    """A training method's part of a run: :class:`Run` calls these, in this order.

    The recipe is constructed with its :class:`Run` (``RecipeClass(run)``) and reads the run's
    ``cfg``, ``ranks``, ``device``, ``out``, ``step`` and ``base_eval_loss`` from it.
    """

    def setup(self) -> Built:
        """Build the model, data and trainer; when resuming, restore the newest checkpoint."""

    def step(self, lr: float) -> Stepped:
        """One optimizer step at learning rate ``lr``."""

    def evaluate(self, step: int) -> Evaluation:
        """The held-out loss (and task score) of the model after ``step`` steps."""

    def save(self) -> None:
        """Checkpoint everything a resume needs, at the run's step."""

    def export(self, out_dir: Path) -> Path:
        """Write the trained model to ``out_dir`` (a Hugging Face directory); return it."""

    def close(self, completed: bool) -> None:
        """Release what setup built, however much of it there is (a setup may have failed);
        ``completed`` is False when a step may have been cut or the run failed."""


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """The learning-rate schedule every recipe follows, as a factor of ``lr`` per step: linear
    warmup to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


class Run:
    """One fine-tuning run: the lifecycle around a :class:`Recipe`; executes once.

    Args:
        config: the run's config.
        sink: where events go (default: ``NullSink``, nothing reported).
    """

    def __init__(self, config: FinetuneConfig, sink: EventSink | None = None) -> None:
        self.cfg = config
        self.sink: EventSink = sink if sink is not None else NullSink()
        self.stop = StopOnSignal()
        self.ranks: Ranks = dist.SINGLE  # this process among the run's (from open())
        self.joined = False  # open() joined the process group: the run leaves it at its end
        self.device = torch.device("cpu")  # open() resolves cfg.device after joining: this rank's GPU
        self.out = Path(config.output)
        self.out_lock: int | None = None  # the output directory's lock (rank 0), held for the run
        self.step = 0  # optimizer steps done
        self.base_eval_loss: float | None = None
        self.losses: list[float] = []  # the train loss of each logged step
        self.lr_at = lr_lambda(config.warmup_steps, config.max_steps, config.min_lr_ratio)
        self.wear: WearMeter | None = None  # from the first step on
        self._store: TieredStore | None = None  # the recipe's, read for each log line's tier figures
        self._saved: tuple[int, float] | None = None  # (step, time.monotonic()) of the newest checkpoint
        self._reported = False  # RunFinished sent: nothing is left to report or release
        self._t0 = time.perf_counter()

    def execute(self, make: Callable[[Run], Recipe]) -> FinetuneResult:
        """open → setup → train → the end (see the module's docstring).

        Args:
            make: the recipe's class (or any ``run -> Recipe``).

        Returns:
            The run's FinetuneResult.

        Raises:
            Interrupted: SIGINT / SIGTERM (after the run was reported interrupted).
            OutcoreError: bad config, model, data, output directory or checkpoint.
        """
        self._t0 = time.perf_counter()
        with self.stop, holding_output_dir(self):
            try:
                result = self._execute(make)
            except RankLostError:
                raise  # no teardown of a group whose peer is gone (it can block): the process exits
            except BaseException:
                self._leave()
                raise
            self._leave()
            return result

    def open(self) -> None:
        """Join the run's ranks, pick this rank's device and threads, take the output directory."""
        cfg = self.cfg
        self.ranks, self.joined = dist.join_run(cfg)  # under torchrun: this rank (distributed/across_ranks.py)
        self.device = resolve_device(cfg.device)  # (after join_run: under torchrun, this rank's GPU)
        set_threads(dist.rank_threads(cfg.threads, self.ranks))
        self.out, self.out_lock = dist.prepare_run_dir(cfg, self.ranks)

    def _execute(self, make: Callable[[Run], Recipe]) -> FinetuneResult:
        recipe: Recipe | None = None
        try:
            recipe = make(self)
            self.open()
            built = recipe.setup()
            self.stop.deferring = True  # signals wait for the end of the step
            try:
                self._train(recipe, built)
            except KeyboardInterrupt as e:
                self.stop.deferring = False
                self._stopped(recipe, e)
                raise
            self.stop.deferring = False
            return self._finish(recipe, completed=True)
        except BaseException:
            if not self._reported:  # e.g. a bad model after the store was made: remove its swap dir
                self._abort(recipe)
            raise

    # ------------------------------------------------------------------ train
    def _train(self, recipe: Recipe, built: Built) -> None:
        """The steps up to ``max_steps``, with their log lines, evals and checkpoints.

        Raises:
            FloatingPointError: the loss became NaN or infinite.
        """
        cfg = self.cfg
        self._started(built)
        if self.base_eval_loss is None:
            self.base_eval_loss = self._evaluate(recipe, self.step)
        t_start = time.perf_counter()
        while self.step < cfg.max_steps:
            dist.check_stop(self.stop, self.ranks, self.out)  # a signal during the last step: stop here
            t0, stall0 = time.perf_counter(), self._stall_s()
            lr = cfg.lr * self.lr_at(self.step)  # linear warmup, then cosine decay
            stepped = recipe.step(lr)
            self.step += 1
            if stepped.checkpointed:
                self._saved = (self.step, time.monotonic())
            step_s = time.perf_counter() - t0  # before any eval: tokens/s is training speed
            stall_s = self._stall_s() - stall0

            eval_loss = None
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                eval_loss = self._evaluate(recipe, self.step)
            if self.step % cfg.log_every == 0 or self.step == cfg.max_steps or eval_loss is not None:
                self._log_step(stepped, lr, built.tokens_per_step, step_s, stall_s, eval_loss,
                               time.perf_counter() - t_start)
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                self._save(recipe)
        dist.check_stop(self.stop, self.ranks, self.out)

    def _started(self, built: Built) -> None:
        """Continue from setup's checkpoint, start counting writes, send RunStarted."""
        cfg = self.cfg
        self.step, self.base_eval_loss = built.checkpoint_step or 0, built.base_eval_loss
        if built.checkpoint_step is not None:  # (its age unknown: old)
            self._saved = (built.checkpoint_step, 0.0)
        self._store = built.store
        self.wear = WearMeter(built.store, cfg.ssd_tbw, built.swap_dir or self.out / "swap", self.out, self.step)
        self.sink.emit(RunStarted(run_name=self.out.name, model=cfg.model, n_params=built.n_params,
                                  n_trainable=built.n_trainable, total_steps=cfg.max_steps, output_dir=str(self.out),
                                  method=cfg.method, optim=cfg.optim, config=cfg.to_dict(),
                                  plan_table=built.plan_table, tokens_per_step=built.tokens_per_step,
                                  activations=built.activations))

    def _stall_s(self) -> float:
        """Seconds compute has waited for a transfer since the store was made (none without one)."""
        return 0.0 if self._store is None else self._store.stall_s

    def _log_step(self, stepped: Stepped, lr: float, tokens: int, step_s: float, stall_s: float,
                  eval_loss: float | None, elapsed_s: float) -> None:
        """The step's StepEvent (on rank 0 with every rank's figures)."""
        assert self.wear is not None  # (made by _started, before the first step)
        loss = float(stepped.loss)  # host sync: only at log steps
        self.losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {self.step}; lower --lr or use dtype=float32")
        norm = stepped.grad_norm
        # the store's counters, bandwidth since the previous log line
        tiers = {} if self._store is None else self._store.tier_stats(window=True)
        event = StepEvent(step=self.step, total_steps=self.cfg.max_steps, loss=loss, lr=lr,
                          tokens_per_s=tokens / step_s, step_s=step_s, elapsed_s=elapsed_s, rss_bytes=rss_bytes(),
                          ram_bytes=ram_total_bytes(), grad_norm=None if norm is None else float(norm),
                          eval_loss=eval_loss, stall_s=stall_s, tiers=tiers, **device_memory(self.device))
        self.sink.emit(dist.with_ranks(self.ranks, self.wear.fill(event), self.out))
        if stepped.rollouts is not None:
            self.sink.emit(stepped.rollouts)

    def _evaluate(self, recipe: Recipe, step: int) -> float:
        result = recipe.evaluate(step)
        self.sink.emit(EvalEvent(step=step, eval_loss=result.loss, perplexity=perplexity(result.loss)))
        for score in (result.task, result.preference, result.reward):
            if score is not None:
                self.sink.emit(score)
        return result.loss

    def _save(self, recipe: Recipe) -> None:
        recipe.save()
        self._saved = (self.step, time.monotonic())

    # ---------------------------------------------------------------- the end
    def _finish(self, recipe: Recipe, completed: bool) -> FinetuneResult:
        """Evaluate, checkpoint and export (when ``completed``), close the recipe, report the end."""
        final_eval = final_dir = None
        if completed:
            final_eval = self._evaluate(recipe, self.step)
            self._save(recipe)
            if self.cfg.export and self.ranks.is_main:  # the replicas are equal: rank 0 exports
                final_dir = recipe.export(self.out / "final")
        recipe.close(completed)
        finished = RunFinished(
            steps_done=self.step, wall_s=time.perf_counter() - self._t0, peak_rss_bytes=peak_rss_bytes(),
            output_dir=str(self.out), base_eval_loss=self.base_eval_loss, final_eval_loss=final_eval,
            interrupted=not completed, final_dir=None if final_dir is None else str(final_dir))
        self.sink.emit(finished if self.wear is None else self.wear.fill(finished))
        self.sink.close()
        self._reported = True
        return FinetuneResult(self.out, self.step, final_dir, self.base_eval_loss, final_eval, self.losses,
                              interrupted=not completed)

    def _stopped(self, recipe: Recipe, stop: KeyboardInterrupt) -> None:
        """Checkpoint a run stopped between steps (unless its newest checkpoint is seconds old),
        then report it interrupted. A bare KeyboardInterrupt may have cut a step in half: no save."""
        if isinstance(stop, Interrupted):
            step, at = self._saved or (0, 0.0)
            if self.step > step and time.monotonic() - at >= RECENT_CHECKPOINT_S:
                self._save(recipe)
            stop.step = self._saved[0] if self._saved else 0
            stop.output = str(self.out) if self._saved else None  # no checkpoint: nothing to resume
        self._finish(recipe, completed=False)

    def _abort(self, recipe: Recipe | None) -> None:
        """A failed run: close what the recipe built and the sink, reporting nothing more."""
        try:
            if recipe is not None:
                recipe.close(completed=False)
        finally:
            self.sink.close()

    def _leave(self) -> None:
        dist.leave_run(self.ranks, self.joined)
        self.joined = False
