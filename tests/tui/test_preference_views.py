"""A preference objective's held-out accuracy and margin in metrics.jsonl, the plain log, the
end-of-run summary and the dashboard."""
from __future__ import annotations

import io
import math

from outcore.events import EvalEvent, PreferenceEvalEvent, RunFinished, RunStarted
from outcore.tui import make_sink
from outcore.tui.metrics import read_metrics


def _events(out, make_step):
    """A 2-step DPO run scored before training and at the end, in the recipe's order."""
    return [RunStarted("dpo-run", "tiny", 1000, 1000, 2, out, config={"objective": "dpo"}), EvalEvent(0, 0.6931, 2.0),
            PreferenceEvalEvent(0, 16, 0.0, 0.0), make_step(1, 2), make_step(2, 2),
            EvalEvent(2, 0.5, math.exp(0.5)), PreferenceEvalEvent(2, 16, 0.75, 0.421),
            RunFinished(2, 5.0, 1 << 30, out, 0.6931, 0.5, False, None)]


def test_preference_scores_in_metrics_and_plain_log(tmp_path, make_step):
    out = tmp_path / "run"
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)
    for ev in _events(str(out), make_step):
        sink.emit(ev)
    sink.close()
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0] == {"step": 0, "eval_loss": 0.6931, "pref_accuracy": 0.0, "pref_margin": 0.0,
                       "time": rows[0]["time"]}
    assert rows[-1]["step"] == 2 and rows[-1]["pref_accuracy"] == 0.75 and rows[-1]["pref_margin"] == 0.421
    text = stream.getvalue()
    assert "preference @ step 2: accuracy 75.0% of 16 pairs, margin +0.4210" in text
    # the summary: the pairs' scores and the loss, no perplexity of a preference loss
    assert "pairs accuracy   base 0.0% -> final 75.0%" in text
    assert "reward margin    base +0.0000 -> final +0.4210" in text
    assert "eval loss (dpo)  base 0.6931 -> final 0.5000" in text and "eval perplexity" not in text


def test_dashboard_shows_the_pairs(tmp_path, make_step):
    from rich.console import Console

    sink = make_sink("rich", tmp_path / "run", stream=io.StringIO())
    for ev in _events(str(tmp_path / "run"), make_step)[:-1]:
        sink.emit(ev)
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(sink.view.render())
    sink.close()
    assert "accuracy 0.0% -> 75.0%  margin +0.0000 -> +0.4210  @2" in console.file.getvalue()
