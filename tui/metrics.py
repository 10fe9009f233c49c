"""``OUTPUT/metrics.jsonl``: one JSON object per logged step, flushed line by line.

Row format (strict JSON, one object per line)::

    {"step": 12, "total_steps": 40, "loss": 2.31, "lr": 4.5e-05, "tokens_per_s": 1210.0,
     "step_s": 0.42, "elapsed_s": 5.1, "rss_bytes": 3400000000, "ram_bytes": ...,
     "stall_s": 0.0, "eval_loss": 2.40,                    # eval_loss only on eval steps
     "ssd_written_bytes": ..., "ssd_written_per_step_bytes": ...,  # SSD wear (training/wear.py)
     "ssd_life_used_pct": ..., "ssd_life_per_1000_steps_pct": ...,  # only with ssd_tbw
     "tiers.NVME.held_bytes": ..., "tiers.NVME.read_gbps": ..., ...,   # one key per tier field
     "time": 1763760000.0}                                  # unix time the row was written

* ``None`` fields (``grad_norm``, ``device_bytes``, ``eval_loss`` ...) are left out; NaN/inf
  are written as ``null`` so that every line parses with a strict JSON reader (``jq``).
* ``ssd_written_bytes``: bytes the run wrote to its swap disk since it started (the swap
  file, setup included, and checkpoints / the export on that disk);
  ``ssd_written_per_step_bytes``: per step since the previous row; with ``ssd_tbw`` the
  percent of the drive's rated writes the run used and that 1000 steps like these would use.
* ``tiers`` is flattened as ``tiers.<TIER>.<field>`` -- the same keys
  ``pandas.json_normalize`` would make -- so the file loads with ``pandas.read_json(lines=True)``.
* Each line is flushed as it is written: a killed run keeps every row it logged.
* An EvalEvent for the step just logged (a final eval after the last StepEvent) is
  merged into that step's row: the last line is rewritten in place with ``eval_loss``.
* A TaskEvalEvent (``eval_task``) adds ``task_acc`` and ``task_acc_norm`` to its step's row
  the same way; the one before training gets a row of its own, ``{"step": 0, "eval_loss":
  ..., "task_acc": ..., "task_acc_norm": ..., "time": ...}`` (no ``loss``: no step ran).
* A PreferenceEvalEvent (a preference objective) adds ``pref_accuracy`` and ``pref_margin``
  (KTO also ``pref_kl``) the same way; GRPO's GRPOStepEvent adds ``reward``, ``reward_std``, ``kl``,
  ``completion_length``, ``generate_s`` and ``train_s``, its RewardEvalEvent ``eval_reward`` and
  ``eval_reward_std``.
* A resumed run appends to the same file. On its first step ``s`` the rows of steps
  ``>= s`` left by the interrupted run (logged after its last checkpoint) are dropped,
  so the file holds each step once. A fresh run (first step 1) therefore starts a new file.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO, Any

from ..events import (EvalEvent, GRPOStepEvent, PreferenceEvalEvent, RewardEvalEvent, RunFinished, RunStarted,
                      StepEvent, TaskEvalEvent)

#: the events whose fields join their step's row (``to_row``)
RowEvent = TaskEvalEvent | PreferenceEvalEvent | GRPOStepEvent | RewardEvalEvent

METRICS_FILENAME = "metrics.jsonl"


def _clean(value: Any) -> Any:
    """NaN/inf -> None (strict JSON); everything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def step_row(event: StepEvent) -> dict[str, Any]:
    """The flat metrics row of one StepEvent (see the module docstring for the format).

    Args:
        event: the step to record.

    Returns:
        A dict of JSON scalars; ``None`` fields are omitted, ``tiers`` is flattened.
    """
    row: dict[str, Any] = {}
    for key, value in event.to_json().items():
        if key in ("tiers", "ranks"):
            continue
        if value is not None:
            row[key] = _clean(value)
    _flatten_tiers(row, "tiers", event.tiers)
    for stats in event.ranks:  # under torchrun (rank 0's row): ranks.R.step_s, ranks.R.tiers.NVME.read_bytes ...
        fields = stats if isinstance(stats, dict) else vars(stats)
        prefix = f"ranks.{fields['rank']}"
        row.update({f"{prefix}.{k}": _clean(v) for k, v in fields.items() if k not in ("rank", "tiers")})
        _flatten_tiers(row, f"{prefix}.tiers", fields.get("tiers") or {})
    return row


def _flatten_tiers(row: dict[str, Any], prefix: str, tiers: dict[str, Any]) -> None:
    for tier, stats in sorted(tiers.items()):
        fields = stats if isinstance(stats, dict) else vars(stats)
        for key, value in fields.items():
            row[f"{prefix}.{tier}.{key}"] = _clean(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read the rows of a metrics file, skipping a torn last line left by a killed run.

    Args:
        path: a ``metrics.jsonl`` file; a missing file reads as no rows.

    Returns:
        The parsed rows in file order.
    """
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    with p.open("r", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a partial line from a run killed mid-write
            if isinstance(row, dict):
                rows.append(row)
    return rows


class MetricsWriter:
    """An EventSink that appends one JSON line per StepEvent to ``OUTPUT/metrics.jsonl``.

    Args:
        output_dir: the run's output directory; when None, the directory named by the
            RunStarted event is used. Created if missing.
        filename: the file in it (rank R > 0 of a torchrun run: ``metrics.rankR.jsonl``).
    """

    def __init__(self, output_dir: str | Path | None = None, filename: str = METRICS_FILENAME) -> None:
        self._dir = Path(output_dir) if output_dir is not None else None
        self._name = filename
        self._file: IO[bytes] | None = None
        self._pending_eval: EvalEvent | None = None
        self._pending_task: RowEvent | None = None
        self._last_row: dict[str, Any] | None = None  # the last row written, and where it starts
        self._last_offset = 0
        self._closed = False
        self.rows_written = 0

    @property
    def path(self) -> Path | None:
        """Where the rows go (None until an output directory is known)."""
        return None if self._dir is None else self._dir / self._name

    def emit(self, event: Any) -> None:
        """Record one event; only StepEvents write rows.

        Raises:
            OSError: the file cannot be written (a full disk must stop the run, not
                silently drop its metrics).
        """
        if self._closed:
            return
        if isinstance(event, RunStarted):
            if self._dir is None and event.output_dir:
                self._dir = Path(event.output_dir)
        elif isinstance(event, EvalEvent):
            last = self._last_row
            if last is not None and last.get("step") == event.step:
                if "eval_loss" not in last:  # an eval after its step's row: complete that row
                    self._rewrite_last({**last, "eval_loss": _clean(event.eval_loss)})
            else:
                # A trainer may send the EvalEvent of step s just before the StepEvent of s
                # without filling StepEvent.eval_loss: merge it into that row.
                self._pending_eval = event
        elif isinstance(event, (TaskEvalEvent, PreferenceEvalEvent, GRPOStepEvent, RewardEvalEvent)):
            self._task(event)
        elif isinstance(event, StepEvent):
            self._write(event)
        elif isinstance(event, RunFinished):
            if self._dir is None and event.output_dir:
                self._dir = Path(event.output_dir)
            self._flush()

    def _task(self, event: RowEvent) -> None:
        fields = {k: _clean(v) for k, v in event.to_row().items()}
        last = self._last_row
        if last is not None and last.get("step") == event.step:
            self._rewrite_last({**last, **fields})
        elif last is None and event.step == 0:  # before training: no step row will come
            self._append({"step": 0}, first_step=0, task=event)
        else:
            self._pending_task = event  # its step's row comes next

    def _write(self, event: StepEvent) -> None:
        self._append(step_row(event), first_step=event.step, task=self._pending_task)

    def _append(self, row: dict[str, Any], first_step: int, task: RowEvent | None) -> None:
        """Write ``row`` with the pending eval and task results of its step merged in."""
        if self._dir is None:
            return  # no output directory: nothing to write to (make_sink(output_dir=None) without RunStarted)
        if self._file is None:
            self._open(first_step=first_step)
        pending = self._pending_eval
        if pending is not None and pending.step == row["step"] and "eval_loss" not in row:
            row["eval_loss"] = _clean(pending.eval_loss)
        if task is not None and task.step == row["step"]:
            row.update({k: _clean(v) for k, v in task.to_row().items()})
        self._pending_eval = self._pending_task = None
        row["time"] = round(time.time(), 3)
        assert self._file is not None
        self._last_offset = self._file.tell()
        self._write_line(row)
        self._last_row = row
        self.rows_written += 1

    def _write_line(self, row: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write((json.dumps(row, allow_nan=False) + "\n").encode("utf-8"))
        # Flush per row: a killed run keeps what it logged (the OS holds it; no fsync needed).
        self._file.flush()

    def _rewrite_last(self, row: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.truncate(self._last_offset)  # append mode: the next write lands at the new end
        self._write_line(row)
        self._last_row = row

    def _open(self, first_step: int) -> None:
        assert self._dir is not None and self.path is not None
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self.path
        if path.exists():
            kept = [r for r in read_metrics(path)
                    if isinstance(r.get("step"), (int, float)) and r["step"] < first_step]
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("w", encoding="utf-8") as f:
                for r in kept:
                    f.write(json.dumps(r, allow_nan=False) + "\n")
            os.replace(tmp, path)  # atomic: a crash here leaves the old or the new file, never half
        self._file = path.open("ab")
        self._file.seek(0, os.SEEK_END)

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
