"""The fan-out sink a trainer writes to: a view + ``metrics.jsonl`` + the end-of-run artifacts.

::

    from outcore.tui import make_sink
    sink = make_sink(config.ui, config.output)
    sink.emit(RunStarted(...)); sink.emit(StepEvent(...)); ...; sink.emit(RunFinished(...))
    sink.close()

At ``RunFinished`` the sink flushes the metrics, draws ``OUTPUT/loss_curve.png``
from the whole ``metrics.jsonl`` (so a resumed run plots its full history), and
hands a :class:`RunSummary` to the view.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import IO, Any

from ..errors import ConfigError
from ..events import EventSink, RunFinished
from ..training.config import UI_MODES
from .metrics import MetricsWriter, read_metrics
from .plot import LOSS_CURVE_FILENAME, curves_from_rows, plot_loss_curve, task_accuracy_from_rows
from .state import RunState
from .summary import RunSummary, summary_paths, wear_fields
from .trackers import Trackers

class NullView:
    """The ``ui="none"`` view: shows nothing."""

    def emit(self, event: Any) -> None:
        pass

    def show_summary(self, summary: RunSummary) -> None:
        pass

    def close(self) -> None:
        pass


class RunSink:
    """Fans each event out to a view and a metrics writer; writes the plot and summary at the end.

    Args:
        view: the human view (Dashboard, PlainView or NullView): ``emit``,
            ``show_summary`` and ``close``.
        output_dir: where ``metrics.jsonl`` and ``loss_curve.png`` go; None = the
            directory named by RunStarted (no files if neither is known).
        trackers: experiment trackers fed every event (``report_to``; default none).
    """

    def __init__(self, view: Any, output_dir: str | Path | None = None, trackers: Trackers | None = None) -> None:
        self.view = view
        self.trackers = trackers or Trackers()
        self.metrics = MetricsWriter(output_dir)
        self.state = RunState()
        self.summary: RunSummary | None = None
        self.loss_curve_path: Path | None = None
        self._closed = False

    @property
    def output_dir(self) -> Path | None:
        path = self.metrics.path
        return None if path is None else path.parent

    def emit(self, event: Any) -> None:
        """Send one event to the metrics file and the view (RunFinished also writes the plot
        and shows the summary)."""
        if self._closed:
            return
        self.state.update(event)
        self.metrics.emit(event)  # first: the row is on disk before anything can fail in the view
        self.view.emit(event)
        self.trackers.emit(event)
        if isinstance(event, RunFinished):
            self._finish(event)

    def _finish(self, event: RunFinished) -> None:
        out = self.output_dir
        if out is not None:
            self.loss_curve_path = self._plot(out, event)
        self.summary = self._summarize(event, out)
        self.view.show_summary(self.summary)

    def _plot(self, out: Path, event: RunFinished) -> Path | None:
        metrics = self.metrics.path
        rows = read_metrics(metrics) if metrics is not None else []
        base = event.base_eval_loss if event.base_eval_loss is not None else self.state.base_eval_loss()
        extra = list(self.state.evals) + ([(0, base)] if base is not None else [])
        train, evals = curves_from_rows(rows, extra)
        if not train:
            return None  # no step finished: nothing worth a plot
        title = self.state.started.run_name if self.state.started else None
        try:
            return plot_loss_curve(train, evals, out / LOSS_CURVE_FILENAME, title=title,
                                   task_acc=task_accuracy_from_rows(rows))
        except ImportError as e:  # matplotlib is a dependency, but a broken install must not lose the run
            warnings.warn(f"loss curve not drawn: {e}", stacklevel=2)
            return None

    def _summarize(self, event: RunFinished, out: Path | None) -> RunSummary:
        st = self.state
        started, last = st.started, st.last
        final = event.final_eval_loss
        if final is None and st.last_eval is not None and st.last_eval[0] > 0:
            final = st.last_eval[1]
        base = event.base_eval_loss if event.base_eval_loss is not None else st.base_eval_loss()
        return RunSummary(
            steps_done=event.steps_done, total_steps=st.total_steps, wall_s=event.wall_s,
            peak_rss_bytes=event.peak_rss_bytes, interrupted=event.interrupted,
            run_name=started.run_name if started else None, model=started.model if started else None,
            method=started.method if started else None, optim=started.optim if started else None,
            ram_bytes=(last.ram_bytes or None) if last else None,
            peak_device_bytes=st.peak_device_bytes, base_eval_loss=base, final_eval_loss=final,
            mean_tokens_per_s=st.mean_tokens_per_s(),
            tokens_per_step=(started.tokens_per_step or None) if started else None,
            activations=(started.activations or None) if started else None,
            **_task_fields(st), **_preference_fields(st),
            **_reward_fields(st),
            **wear_fields(event),
            paths=summary_paths(out, event.final_dir, self.metrics.path, self.loss_curve_path,
                                event.interrupted))

    def close(self) -> None:
        """Flush and close the metrics file and stop the view (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.view.close()
            self.trackers.close()
        finally:
            self.metrics.close()


def resolve_ui(ui: str, stream: IO[str] | None = None) -> str:
    """Turn ``"auto"`` into ``"rich"`` (a terminal, env ``CI`` unset) or ``"plain"``.

    Args:
        ui: one of ``auto | rich | plain | none``.
        stream: the stream the view writes to (default ``sys.stdout``).

    Returns:
        ``"rich"``, ``"plain"`` or ``"none"``.

    Raises:
        ConfigError: ``ui`` is not one of the choices.
    """
    if ui not in UI_MODES:
        raise ConfigError(f"ui={ui!r} is not one of: {', '.join(UI_MODES)}")
    if ui != "auto":
        return ui
    stream = stream if stream is not None else sys.stdout
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or file-like without isatty
        tty = False
    return "rich" if tty and not os.environ.get("CI") else "plain"


def make_sink(ui: str = "auto", output_dir: str | Path | None = None, *,
              stream: IO[str] | None = None, report_to: list[str] | tuple[str, ...] = (),
              rank: int = 0) -> EventSink:
    """Build the sink a trainer emits its events to.

    Args:
        ui: ``"rich"`` (live dashboard), ``"plain"`` (one line per step/eval),
            ``"none"`` (no view; files only) or ``"auto"`` (rich on a terminal when env
            ``CI`` is unset, else plain).
        output_dir: the run's output directory for ``metrics.jsonl`` and
            ``loss_curve.png``; None = the one named by the RunStarted event.
        stream: where the view writes (default ``sys.stdout``).
        report_to: experiment trackers to feed too (``tui/trackers.py``).
        rank: this process's rank under torchrun: rank 0 shows the view (with every rank's
            tiers) and feeds the trackers; rank R > 0 only writes ``metrics.rankR.jsonl``.

    Returns:
        A :class:`RunSink` (``emit(event)``, ``close()``), or rank R's :class:`MetricsWriter`.

    Raises:
        ConfigError: ``ui`` is not one of the choices, or a tracker is unknown or not installed.
    """
    if rank > 0:  # no live view: rank 0's dashboard shows this rank's row
        resolve_ui(ui, stream)  # a bad ui fails on every rank alike
        return MetricsWriter(output_dir, f"metrics.rank{rank}.jsonl")
    trackers = Trackers(report_to)  # first: a missing tracker library fails before any view starts
    mode = resolve_ui(ui, stream)
    view: Any
    if mode == "rich":
        from rich.console import Console

        from .dashboard import Dashboard

        view = Dashboard(Console(file=stream) if stream is not None else None)
    elif mode == "plain":
        from .plain import PlainView

        view = PlainView(stream)
    else:
        view = NullView()
    return RunSink(view, output_dir, trackers)


__all__ = ["RunSink", "NullView", "make_sink", "resolve_ui"]


def _preference_fields(state: RunState) -> dict[str, Any]:
    """The summary's objective, and a preference objective's scores before training and at the end."""
    objective = state.started.config.get("objective") if state.started else None
    before, after = state.preference_before_after()
    return {"objective": objective,
            "base_pref_accuracy": before.accuracy if before else None,
            "final_pref_accuracy": after.accuracy if after else None,
            "base_pref_margin": before.margin if before else None,
            "final_pref_margin": after.margin if after else None}


def _reward_fields(state: RunState) -> dict[str, Any]:
    """GRPO's held-out mean reward before training and at the end."""
    before, after = state.reward_before_after()
    return {"base_eval_reward": before.reward if before else None,
            "final_eval_reward": after.reward if after else None}


def _task_fields(state: RunState) -> dict[str, Any]:
    """The summary's task fields: the task scored before training and after the last step."""
    before, after = state.task_before_after()
    if before is None and after is None:
        return {}
    return {"task": (before or after).task,
            "base_task_acc": before.acc if before else None, "final_task_acc": after.acc if after else None,
            "base_task_acc_norm": before.acc_norm if before else None,
            "final_task_acc_norm": after.acc_norm if after else None}
