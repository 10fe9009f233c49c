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


def test_dashboard_shows_the_pairs(tmp_path, make_step, dashboard_text):
    shown = dashboard_text(_events(str(tmp_path / "run"), make_step)[:-1], tmp_path / "run")
    assert "accuracy 0.0% -> 75.0%  margin +0.0000 -> +0.4210  @2" in shown


def test_kto_scores_show_examples_and_kl(tmp_path, make_step, dashboard_text):
    out = tmp_path / "run"
    events = [RunStarted("kto-run", "tiny", 1000, 1000, 2, str(out), config={"objective": "kto"}),
              EvalEvent(0, 0.5, 2.0), PreferenceEvalEvent(0, 12, 0.0, 0.0, kl=0.0), make_step(1, 2),
              make_step(2, 2), EvalEvent(2, 0.4, math.exp(0.4)), PreferenceEvalEvent(2, 12, 0.75, 0.3, kl=0.0123),
              RunFinished(2, 5.0, 1 << 30, str(out), 0.5, 0.4, False, None)]
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)
    for ev in events:
        sink.emit(ev)
    sink.close()
    assert read_metrics(out / "metrics.jsonl")[-1]["pref_kl"] == 0.0123
    text = stream.getvalue()
    assert "preference @ step 2: accuracy 75.0% of 12 examples, margin +0.3000, KL 0.0123" in text
    assert "examples accuracy  base 0.0% -> final 75.0%" in text

    shown = dashboard_text(events[:-1], tmp_path / "run2")
    assert "rewards  accuracy 0.0% -> 75.0%  margin +0.0000 -> +0.3000  KL 0.0123  @2" in shown
