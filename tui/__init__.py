"""The ``outcore`` command line, the live dashboard, plain logs, ``metrics.jsonl`` and plots.

Nothing here imports torch: the UI renders :mod:`outcore.events` (ARCHITECTURE.md §1).
rich and matplotlib are imported only when a dashboard or a plot is made.

    from outcore.tui import make_sink
    sink = make_sink(config.ui, config.output)   # view + OUTPUT/metrics.jsonl + loss_curve.png
    sink.emit(event)                             # RunStarted / StepEvent / EvalEvent / RunFinished
    sink.close()
"""
from __future__ import annotations

from .sinks import NullView, RunSink, make_sink, resolve_ui
from .summary import RunSummary

__all__ = ["make_sink", "resolve_ui", "RunSink", "NullView", "RunSummary"]
