"""A labelled task's accuracy (``finetune eval_task=``) in metrics.jsonl, the plain log, the
dashboard, the summary and the loss curve."""
from __future__ import annotations

import io
import math

from outcore.events import EvalEvent, RunFinished, RunStarted, TaskEvalEvent
from outcore.tui import make_sink
from outcore.tui.metrics import read_metrics
from outcore.tui.plot import task_accuracy_from_rows


def _task_run_events(out, make_step):
    """A 4-step run scored before training, at step 2 and at the end, in the recipe's order."""
    evs = [RunStarted("task-run", "tiny", 1000, 1000, 4, out), EvalEvent(0, 3.5, math.exp(3.5)),
           TaskEvalEvent(0, "mc", 40, 0.25, 0.3)]
    for s in range(1, 5):
        if s == 2:  # a mid-run eval comes before its step's row
            evs += [EvalEvent(2, 3.2, math.exp(3.2)), TaskEvalEvent(2, "mc", 40, 0.4, 0.35)]
        evs.append(make_step(s, 4, eval_loss=3.2 if s == 2 else None))
    evs += [EvalEvent(4, 3.0, math.exp(3.0)), TaskEvalEvent(4, "mc", 40, 0.5, 0.45),
            RunFinished(4, 5.0, 1 << 30, out, 3.5, 3.0, False, None)]
    return evs


def test_task_accuracy_in_metrics_log_summary_and_plot(tmp_path, make_step):
    out = tmp_path / "run"
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)
    for ev in _task_run_events(str(out), make_step):
        sink.emit(ev)
    sink.close()
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0] == {"step": 0, "eval_loss": 3.5, "task_acc": 0.25, "task_acc_norm": 0.3, "time": rows[0]["time"]}
    assert [(r["step"], r["task_acc"]) for r in rows if "task_acc" in r] == [(0, 0.25), (2, 0.4), (4, 0.5)]
    assert rows[4]["eval_loss"] == 3.0 and rows[4]["task_acc_norm"] == 0.45
    assert task_accuracy_from_rows(rows) == [(0, 0.25), (2, 0.4), (4, 0.5)]
    text = stream.getvalue()
    assert "task mc @ step 0: acc 25.0% (10/40), acc_norm 30.0%" in text
    assert "task accuracy    mc: base 25.0% -> final 50.0%" in text
    assert "task acc_norm    mc: base 30.0% -> final 45.0%" in text
    assert sink.summary.base_task_acc == 0.25 and sink.summary.final_task_acc == 0.5
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_dashboard_shows_the_task(tmp_path, make_step, dashboard_text):
    shown = dashboard_text(_task_run_events(str(tmp_path / "run"), make_step)[:-1], tmp_path / "run")
    assert "mc  acc 25.0% -> 50.0%  acc_norm 30.0% -> 45.0%  @4" in shown
