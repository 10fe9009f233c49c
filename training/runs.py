"""What a run leaves: what a recipe returns (:class:`FinetuneResult`), and what its directory
says about it: finished, interrupted (resumable) or failed.

A run is a directory holding ``config.yaml`` (written first, by ``prepare_output_dir``).
What else it holds tells how far it went:

* a complete checkpoint (``checkpoints/step_N`` with its ``COMPLETE`` marker) or, for a
  zeroth-order run, ``zo_log.jsonl`` (one line per step: the log is its checkpoint) —
  ``--resume`` continues from step N;
* ``final/`` — written by ``cleanup`` after the last checkpoint, at ``max_steps``;
* ``metrics.jsonl`` — one row per logged step, eval losses on eval steps (read by the
  caller: it is the UI's file, so it comes in as rows).

Statuses: **finished** — a checkpoint at ``max_steps`` and ``final/`` (or ``export=false``);
**running** — a live process holds the output directory's run lock (or its swap directory's);
**interrupted** — a checkpoint to resume from (a Ctrl-C, a crash, a kill); **failed** — nothing
to resume from (it stopped before its first checkpoint, or its config is unreadable).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError

FINISHED, RUNNING, INTERRUPTED, FAILED = "finished", "running", "interrupted", "failed"
CONFIG_NAME = "config.yaml"
ZO_LOG_NAME = "zo_log.jsonl"  # optim/zo_replay.LOG_NAME (that module imports torch)


@dataclass
class FinetuneResult:
    """What a finished (or interrupted) run leaves behind."""

    output_dir: Path
    steps_done: int
    final_dir: Path | None
    base_eval_loss: float | None
    final_eval_loss: float | None
    losses: list[float] = field(default_factory=list)  # train loss of each logged step
    interrupted: bool = False


@dataclass
class RunInfo:
    """One run directory, summarised.

    Attributes:
        path: the run directory.
        status: ``finished``, ``running``, ``interrupted`` or ``failed``.
        steps_done: the last step it logged or checkpointed (0: none).
        max_steps: the steps it was asked for (None: config unreadable).
        resume_step: the step ``--resume`` continues from (None: nothing to resume).
        eval_loss: the last eval loss it logged (the final one for a finished run).
        method: ``full``, ``lora``, ``qlora`` or ``zo`` (with the optimizer).
        model: the model spec it trained.
        note: why a run failed, or what to do next.
    """

    path: Path
    status: str
    steps_done: int
    max_steps: int | None
    resume_step: int | None
    eval_loss: float | None
    method: str | None
    model: str | None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON scalars (``path`` as a string)."""
        return {**asdict(self), "path": str(self.path)}


def find_runs(root: str | Path) -> list[Path]:
    """The run directories at or under ``root`` (a run's own subfolders are not searched).

    Args:
        root: a run directory, or a folder of runs (nested folders are searched).

    Returns:
        The runs, sorted by path.

    Raises:
        ConfigError: ``root`` is not a directory.
    """
    top = Path(root)
    if not top.is_dir():
        raise ConfigError(f"{str(top)!r} is not a directory; pass a folder of runs (default runs/)")
    found = []
    for folder, subdirs, files in os.walk(top):
        if CONFIG_NAME in files:
            found.append(Path(folder))
            subdirs.clear()  # final/, checkpoints/: parts of this run
        subdirs.sort()
    return sorted(found)


def describe_run(run_dir: str | Path, metrics_rows: Iterable[dict[str, Any]] = ()) -> RunInfo:
    """Summarise one run directory.

    Args:
        run_dir: a directory holding ``config.yaml``.
        metrics_rows: the rows of its ``metrics.jsonl`` (``tui.metrics.read_metrics``), if any.

    Returns:
        Its :class:`RunInfo`.
    """
    from .checkpoint.files import latest_checkpoint
    from .config import load_config

    path = Path(run_dir)
    rows = list(metrics_rows)
    logged = max((int(r["step"]) for r in rows if isinstance(r.get("step"), int)), default=0)
    evals = [r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    eval_loss = float(evals[-1]) if evals else None
    try:
        cfg = load_config(path / CONFIG_NAME, resume=None, overwrite=True)
    except (ConfigError, OSError) as err:
        return RunInfo(path, FAILED, logged, None, None, eval_loss, None, None,
                       note=f"config.yaml unreadable: {' '.join(str(err).split())}")
    if cfg.zeroth_order:
        saved = _zo_steps(path / ZO_LOG_NAME)
    else:
        last = latest_checkpoint(path)
        saved = int(last.name.removeprefix("step_")) if last is not None else 0
    method = f"{cfg.method}/{cfg.optim}"
    steps = max(logged, saved)
    if saved >= cfg.max_steps and ((path / "final" / "config.json").is_file() or not cfg.export):
        return RunInfo(path, FINISHED, steps, cfg.max_steps, None, eval_loss, method, cfg.model)
    if _run_in_progress(path, Path(cfg.swap_dir) if cfg.swap_dir else path / "swap"):
        return RunInfo(path, RUNNING, steps, cfg.max_steps, None, eval_loss, method, cfg.model)
    if saved > 0:
        return RunInfo(path, INTERRUPTED, steps, cfg.max_steps, saved, eval_loss, method, cfg.model,
                       note=f"outcore finetune --resume {path}")
    why = f"stopped at step {logged} before its first checkpoint" if logged else "stopped before its first step"
    return RunInfo(path, FAILED, steps, cfg.max_steps, None, eval_loss, method, cfg.model, note=why)


def _run_in_progress(path: Path, swap: Path) -> bool:
    """A live run holds the output directory's lock, or its swap directory's (a killed run
    leaves them unlocked)."""
    from ..offload.store import LOCK_NAME, is_locked
    from .output_dir import RUN_LOCK

    return is_locked(path / RUN_LOCK) or is_locked(swap / LOCK_NAME)


def _zo_steps(log: Path) -> int:
    """The steps a ZO log holds: its lines after the header (each line is flushed whole)."""
    if not log.is_file():
        return 0
    with log.open("r", encoding="utf-8") as f:
        return max(sum(1 for line in f if line.strip()) - 1, 0)
