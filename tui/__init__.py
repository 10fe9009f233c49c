"""The live dashboard, plain logs, ``metrics.jsonl`` and plots (the command line is ``outcore.cli``).

Nothing here imports torch at import time: the UI renders :mod:`outcore.events`
(docs/architecture.md §1); rich and matplotlib are imported only when a dashboard or a
plot is made.

Modules: ``sinks`` (make_sink fan-out), ``dashboard`` (rich Live view),
``plain`` (log lines), ``metrics`` (metrics.jsonl), ``plot`` (loss_curve.png),
``summary`` (end-of-run summary), ``state`` (events folded for the views), ``format``.

    from outcore.tui import make_sink
    sink = make_sink(config.ui, config.output)   # view + OUTPUT/metrics.jsonl + loss_curve.png
    sink.emit(event)                             # RunStarted / StepEvent / EvalEvent / RunFinished
    sink.close()
"""
from __future__ import annotations

from .sinks import NullView, RunSink, make_sink, resolve_ui
from .summary import RunSummary

__all__ = ["make_sink", "resolve_ui", "RunSink", "NullView", "RunSummary"]
