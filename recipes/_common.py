"""Pieces every recipe shares: the output directory, memory readings, the schedule, eval, LoRA.

Kept out of the recipe scripts so that each script reads top to bottom as
setup → train → cleanup without bookkeeping in the way.
"""
from __future__ import annotations

import math
import os
import resource
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from ..errors import CheckpointError, ConfigError, Interrupted
from .config import FinetuneConfig, load_config, save_config

RUN_LOCK = ".outcore-run.lock"  # held by the live run of an output directory
_RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
# Fields a resumed run must share with the run it continues (others, such as
# max_steps or eval_every, may change).
# (grad_accum may change with the number of ranks, their product kept: recipes/distributed.py)
_RUN_DEFINING = ("model", "data", "data_max_bytes", "val_fraction", "seq_len", "method", "optim",
                 "optim_args", "batch_size", "seed", "dtype", "lora_r", "lora_alpha",
                 "lora_targets", "offload")


class StopOnSignal:
    """SIGINT and SIGTERM during a run: stop cleanly at the next step boundary.

    A signal in the middle of a step would leave it half applied (some units updated,
    the step counter and the data position not), so while :attr:`deferring` the handler
    only notes the signal and :meth:`check`, called between steps, raises
    :class:`~outcore.errors.Interrupted`. Outside the loop (setup, the final export) it
    raises at once, as Ctrl-C always did. A second signal exits at once with 128 + its
    number: checkpoints are written to ``.tmp`` and renamed, so that never corrupts one.

    Handlers are installed only in the main thread (Python delivers signals there) and
    restored on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferring = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second one: the user wants out now
            os.write(2, f"outcore: {signal.Signals(signum).name} again: exiting at once "
                        "(complete checkpoints are intact)\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if not self.deferring:
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise :class:`~outcore.errors.Interrupted` if a signal came since the run began."""
        if self.signum is not None:
            raise Interrupted(self.signum)


def prepare_output_dir(config: FinetuneConfig) -> tuple[Path, int]:
    """Create (or, for a resume, check) the output directory, lock it and write config.yaml.

    Returns:
        ``(path, lock)``: the directory and the descriptor holding its run lock (close it
        when the run ends; the kernel drops it if the process dies).

    Raises:
        ConfigError: the directory holds another run and neither resume nor overwrite was
            asked, or a live run holds it.
        CheckpointError: resume was asked but the directory has no run to resume.
    """
    out = Path(config.output)
    if config.resume and not out.is_dir():
        raise CheckpointError(f"--resume {config.resume!r}: no run found there (no such directory); check the path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create output directory {str(out)!r} ({e.strerror}); choose another --output") from e
    lock = _lock_output_dir(out)  # before anything in it is read or removed
    try:
        _check_or_clear(config, out)
    except BaseException:
        os.close(lock)
        raise
    save_config(config, out / "config.yaml")
    return out, lock


@contextmanager
def holding_output_dir(recipe: Any) -> Iterator[None]:
    """For the length of a recipe's ``run()``: the output-directory lock its setup takes
    (``recipe.out_lock``, from :func:`prepare_output_dir`) is released when the run ends,
    however it ends, so the same process may start another run there."""
    recipe.out_lock = None
    try:
        yield
    finally:
        if recipe.out_lock is not None:
            os.close(recipe.out_lock)
            recipe.out_lock = None


def _lock_output_dir(out: Path) -> int:
    """Hold ``OUTPUT/.outcore-run.lock`` for the run: a second run on the same output
    directory — even with ``--overwrite`` — is refused before it touches the first's files."""
    from ..offload.store import LockHeld, hold_lock

    try:
        return hold_lock(out / RUN_LOCK)
    except LockHeld as e:
        raise ConfigError(f"output directory {str(out)!r} is in use by another outcore run (pid {e.pid}); "
                          "wait for it to finish or choose another --output") from e
    except OSError as e:
        raise ConfigError(f"output directory {str(out)!r} is not writable ({e.strerror}); "
                          "choose another --output") from e


def _check_or_clear(config: FinetuneConfig, out: Path) -> None:
    """Check a resumed run agrees with the one it continues; clear a run being overwritten."""
    holds_run = any((out / m).exists() for m in _RUN_MARKERS)
    if config.resume:
        if not holds_run or not (out / "config.yaml").is_file():
            raise CheckpointError(f"--resume {config.resume!r}: no run found there "
                                  "(expected config.yaml and checkpoints/); check the path")
        saved = load_config(out / "config.yaml", resume=None, overwrite=True)
        for key in _RUN_DEFINING:
            if getattr(saved, key) != getattr(config, key):
                raise CheckpointError(
                    f"--resume {config.resume!r}: {key}={getattr(config, key)!r} differs from the "
                    f"run's {key}={getattr(saved, key)!r}; drop it, or start a new run with another --output")
    elif holds_run:
        if not config.overwrite:
            raise ConfigError(f"output directory {str(out)!r} already holds a run; pass --resume "
                              f"{str(out)!r} to continue it, --overwrite to replace it, or another --output")
        for m in (*_RUN_MARKERS, "final", "loss_curve.png", "zo_log.jsonl",
                  *(p.name for p in out.glob("metrics.rank*.jsonl"))):  # other ranks' of a torchrun run
            p = out / m
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads for torch (0 = every core)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def ram_total_bytes() -> int:
    return psutil.virtual_memory().total


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def evaluate(loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], dataset: Any,
             batch_size: int, n_batches: int) -> float:
    """Token-weighted mean loss over the fixed validation batches.

    Args:
        loss_fn: batch -> mean loss over its labelled tokens.
        n_batches: how many batches of the validation set (0 = all of it).

    Returns:
        The mean loss (a float: this is a host sync, once per evaluation).
    """
    from ..data import eval_batches

    total, tokens = 0.0, 0
    for batch in eval_batches(dataset, batch_size, n_batches):
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(loss_fn(batch)) * n
        tokens += n
    return total / max(tokens, 1)


def with_lora(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters on ``cfg.lora_targets`` (seeded; see ``models.add_lora``)."""
    from ..models import add_lora

    return add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                    targets=cfg.lora_targets, seed=cfg.seed)
