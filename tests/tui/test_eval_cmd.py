"""``outcore eval`` and ``finetune eval_task=``: the command, its errors, and the task's
accuracy in metrics.jsonl, the plain log, the dashboard, the summary and the loss curve."""
from __future__ import annotations

import io
import json
import math

import pytest

from outcore.events import EvalEvent, RunFinished, RunStarted, TaskEvalEvent
from outcore.tui import make_sink
from outcore.cli import main
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


def test_dashboard_shows_the_task(tmp_path, make_step):
    from rich.console import Console

    stream = io.StringIO()
    sink = make_sink("rich", tmp_path / "run", stream=stream)
    for ev in _task_run_events(str(tmp_path / "run"), make_step)[:-1]:
        sink.emit(ev)
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(sink.view.render())
    shown = console.file.getvalue()
    sink.close()
    assert "mc  acc 25.0% -> 50.0%  acc_norm 30.0% -> 45.0%  @4" in shown


@pytest.mark.parametrize("line, message", [
    ('{"choices": ["a", "b"], "gold": 0}', "no the query"),
    ('{"query": "q", "choices": ["a", "b"], "gold": 5}', "answer index 5 is out of range for 2 choices"),
    ("", "has no example"),
])
def test_bad_task_file_is_one_line_exit_2(tmp_path, capsys, line, message):
    task = tmp_path / "task.jsonl"
    task.write_text(line + "\n")
    assert main(["eval", "/nonexistent-model", "--task", str(task)]) == 2  # the task fails before the model
    err = capsys.readouterr().err
    assert err.startswith("outcore: error: ") and err.count("\n") == 1 and message in err


def test_eval_cli_on_a_tiny_model(tiny_run_inputs, capsys):
    args = ["eval", str(tiny_run_inputs / "model"), "--data", str(tiny_run_inputs / "data.txt"), "--seq-len", "32",
            "--val-fraction", "0.1", "--eval-batches", "2", "--task", "shakespeare"]
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["perplexity"] == pytest.approx(math.exp(report["eval_loss"]))
    assert report["eval_tokens"] == 2 * 2 * 31 and report["offload"] == "none"
    assert report["task"]["task"] == "shakespeare_mc" and report["task"]["n"] == 40
    assert 0 <= report["task"]["acc"] <= 1
    assert main(args[:2] + ["--task", "shakespeare"]) == 0  # a task alone: no perplexity
    text = capsys.readouterr().out
    assert "task accuracy" in text and "perplexity" not in text


def test_finetune_eval_task_then_eval_the_run(tiny_run_inputs, tmp_path, capsys):
    """Accuracy before and after training in metrics.jsonl and the summary; ``outcore eval RUN_DIR``
    reproduces the run's final eval loss and task accuracy."""
    import outcore

    out = tmp_path / "run"
    result = outcore.finetune(model=str(tiny_run_inputs / "model"), data=str(tiny_run_inputs / "data.txt"),
                              seq_len=32, max_steps=3, lr=1e-3, output=str(out), eval_every=0, eval_batches=2,
                              warmup_steps=1, val_fraction=0.1, eval_task="shakespeare", ui="plain")
    rows = read_metrics(out / "metrics.jsonl")
    task_rows = [r for r in rows if "task_acc" in r]
    assert [r["step"] for r in task_rows] == [0, 3]
    logged = capsys.readouterr().out
    assert "task shakespeare_mc @ step 0: acc" in logged and "task accuracy    shakespeare_mc: base" in logged

    assert main(["eval", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["eval_loss"] == pytest.approx(result.final_eval_loss, rel=1e-5)
    assert report["task"]["acc"] == task_rows[-1]["task_acc"]
    assert report["task"]["acc_norm"] == task_rows[-1]["task_acc_norm"]


@pytest.mark.slow(ci=True)
def test_eval_cli_on_the_embedded_default(capsys):
    assert main(["eval", "--eval-batches", "2", "--task", "shakespeare", "--data", "default", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "default" and report["task"]["n"] == 40
    assert 1.0 < report["perplexity"] < 200.0  # SmolLM2-135M on Shakespeare: a real model, not noise
    assert report["task"]["acc"] > 0.25  # above chance (4 choices) on famous lines
