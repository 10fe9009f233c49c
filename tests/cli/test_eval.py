"""``outcore eval`` and ``finetune eval_task=``: the command, its errors, and a run's task
accuracy read back by ``outcore eval``."""
from __future__ import annotations

import json
import math

import pytest

from outcore.cli import main
from outcore.tui.metrics import read_metrics


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
