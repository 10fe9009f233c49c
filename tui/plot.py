"""The loss-curve PNG (``OUTPUT/loss_curve.png``): train and eval loss against step, and the
eval task's accuracy on a second axis when the run scored one (``eval_task``).

matplotlib is imported lazily, and only its object-oriented API is used (a
``Figure`` on an Agg canvas, no ``pyplot``): nothing global is switched, so the
plot is safe to draw from any thread and never opens a window.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

LOSS_CURVE_FILENAME = "loss_curve.png"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def curves_from_rows(rows: Iterable[dict[str, Any]],
                     extra_evals: Iterable[tuple[int, float]] = ()) -> tuple[list[tuple[int, float]],
                                                                             list[tuple[int, float]]]:
    """Split metrics rows into a train-loss and an eval-loss series.

    Args:
        rows: ``metrics.jsonl`` rows (``step``, ``loss``, optional ``eval_loss``).
        extra_evals: more ``(step, eval_loss)`` points, e.g. the base model's eval at step 0.

    Returns:
        ``(train, evals)``: lists of ``(step, loss)`` sorted by step; a step seen
        twice keeps its last value; non-finite values are dropped.
    """
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    for row in rows:
        step = row.get("step")
        if not _finite(step):
            continue
        if _finite(row.get("loss")):
            train[int(step)] = float(row["loss"])
        if _finite(row.get("eval_loss")):
            evals[int(step)] = float(row["eval_loss"])
    for step, loss in extra_evals:
        if _finite(step) and _finite(loss):
            evals[int(step)] = float(loss)
    return sorted(train.items()), sorted(evals.items())


def task_accuracy_from_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[int, float]]:
    """The ``(step, task_acc)`` points of metrics rows (``eval_task`` runs), sorted by step.

    Args:
        rows: ``metrics.jsonl`` rows.

    Returns:
        One point per step that has a finite ``task_acc`` (a step seen twice keeps its last).
    """
    acc = {int(r["step"]): float(r["task_acc"]) for r in rows
           if _finite(r.get("step")) and _finite(r.get("task_acc"))}
    return sorted(acc.items())


def smoothed(points: Sequence[tuple[int, float]], weight: float = 0.9) -> list[tuple[int, float]]:
    """An exponential moving average of ``(step, loss)`` points, debiased as TensorBoard's
    smoothing is (the first point is itself, not pulled towards zero).

    Args:
        points: ``(step, loss)`` in step order.
        weight: how much each point keeps of the average before it (0: no smoothing).

    Returns:
        ``(step, smoothed loss)`` for every point.
    """
    out, avg = [], 0.0
    for i, (step, loss) in enumerate(points):
        avg = weight * avg + (1 - weight) * loss
        out.append((step, avg / (1 - weight ** (i + 1))))
    return out


def plot_loss_curve(train: Sequence[tuple[int, float]], evals: Sequence[tuple[int, float]],
                    path: str | Path, title: str | None = None,
                    task_acc: Sequence[tuple[int, float]] = ()) -> Path:
    """Draw train loss (raw, and smoothed from 10 points on), eval loss (markers) and the eval
    task's accuracy (on a second axis, 0-100%) against step and save a PNG.

    Args:
        train: ``(step, loss)`` points of the training loss.
        evals: ``(step, eval_loss)`` points (may be empty).
        path: the PNG to write (its directory must exist).
        title: a title, e.g. the run or model name.
        task_acc: ``(step, accuracy in [0, 1])`` points of the eval task (may be empty).

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: there is no point to draw.
    """
    if not train and not evals:
        raise ValueError("no loss values to plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 4.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        xs, ys = zip(*train)
        noisy = len(train) >= 10  # per-step loss is noisy: draw it faint, its trend solid
        ax.plot(xs, ys, color="#1f77b4", linewidth=1.0 if noisy else 1.4, alpha=0.35 if noisy else 1.0,
                label="train loss", marker="." if len(train) < 30 else None)
        if noisy:
            ax.plot(*zip(*smoothed(train)), color="#1f77b4", linewidth=1.8, label="train loss (smoothed)")
    if evals:
        xs, ys = zip(*evals)
        ax.plot(xs, ys, color="#d62728", linewidth=1.0, linestyle="--", marker="o",
                markersize=5, label="eval loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if task_acc:
        twin = ax.twinx()  # accuracy is a share, not a loss: its own 0-100% scale on the right
        xs, ys = zip(*task_acc)
        twin.plot(xs, [100 * y for y in ys], color="#2ca02c", linewidth=1.0, linestyle=":", marker="s",
                  markersize=5, label="task accuracy")
        twin.set_ylim(0, 100)
        twin.set_ylabel("task accuracy (%)")
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="best")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
