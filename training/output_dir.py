"""A run's output directory: created, or checked for a resume, locked for the run's life,
and its ``config.yaml`` written before anything else."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError, ConfigError
from .config import FinetuneConfig, load_config, save_config

RUN_LOCK = ".outcore-run.lock"  # held by the live run of an output directory
_RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
# Fields a resumed run must share with the run it continues (others, such as
# max_steps or eval_every, may change).
# (grad_accum may change with the number of ranks, their product kept: distributed/across_ranks.py)
_RUN_DEFINING = ("model", "data", "data_max_bytes", "val_fraction", "seq_len", "method", "optim",
                 "optim_args", "batch_size", "seed", "dtype", "lora_r", "lora_alpha",
                 "lora_targets", "offload")


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


class HoldsRunLock(Protocol):
    """What holds a run's output-directory lock: the run (``training.lifecycle.Run``)."""

    out_lock: int | None  # the descriptor :func:`prepare_output_dir` returned (None: none taken)


@contextmanager
def holding_output_dir(run: HoldsRunLock) -> Iterator[None]:
    """For the length of a run: the output-directory lock it takes (``run.out_lock``, from
    :func:`prepare_output_dir`) is released when the run ends, however it ends, so the same
    process may start another run there."""
    run.out_lock = None
    try:
        yield
    finally:
        if run.out_lock is not None:
            os.close(run.out_lock)
            run.out_lock = None


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
