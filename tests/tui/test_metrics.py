"""OUTPUT/metrics.jsonl: one strict-JSON row per StepEvent, flushed, resumable."""
from __future__ import annotations

import json
import math

from outcore.events import EvalEvent, RunFinished, RunStarted
from outcore.tui.metrics import METRICS_FILENAME, MetricsWriter, read_metrics, step_row


def test_row_has_required_keys_flat_tiers_and_omits_none(make_step):
    row = step_row(make_step(3, tiers=True))
    for key in ("step", "loss", "lr", "tokens_per_s", "rss_bytes"):
        assert key in row
    assert "eval_loss" not in row and "device_bytes" not in row  # None fields left out
    assert row["tiers.NVME.written_bytes"] == 3 * (1 << 30)
    assert row["tiers.HOST.budget_bytes"] == 8 * (1 << 30)
    assert not any(isinstance(v, dict) for v in row.values())
    assert step_row(make_step(5, eval_loss=2.25))["eval_loss"] == 2.25


def test_rows_are_flushed_as_written(tmp_path, make_step):
    w = MetricsWriter(tmp_path)
    w.emit(make_step(1))
    w.emit(make_step(2))
    # read while the writer is still open: a killed run keeps these rows
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILENAME).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == make_step(1).loss and "time" in rows[0]
    w.close()
    w.close()  # idempotent
    w.emit(make_step(3))  # ignored after close
    assert len(read_metrics(tmp_path / METRICS_FILENAME)) == 2


def test_nonfinite_values_are_strict_json_null(tmp_path, make_step):
    w = MetricsWriter(tmp_path)
    w.emit(make_step(1, loss=math.nan, grad_norm=math.inf))
    w.close()
    line = (tmp_path / METRICS_FILENAME).read_text()
    assert "NaN" not in line and "Infinity" not in line
    row = json.loads(line)
    assert row["loss"] is None and row["grad_norm"] is None


def test_output_dir_from_run_started_and_created(tmp_path, make_step):
    out = tmp_path / "a" / "b"
    w = MetricsWriter(None)
    assert w.path is None
    w.emit(RunStarted("r", "m", 1, 1, 2, str(out)))
    w.emit(make_step(1, total=2))
    w.close()
    assert read_metrics(out / METRICS_FILENAME)[0]["step"] == 1


def test_eval_event_before_its_step_is_merged(tmp_path, make_step):
    w = MetricsWriter(tmp_path)
    w.emit(EvalEvent(0, 3.0, math.exp(3.0)))  # base eval: no row of its own
    w.emit(make_step(1))
    w.emit(EvalEvent(2, 2.5, math.exp(2.5)))
    w.emit(make_step(2))
    w.emit(make_step(3, eval_loss=2.4))  # the trainer filled it itself
    w.emit(RunFinished(3, 1.0, 1, str(tmp_path)))
    w.close()
    rows = read_metrics(tmp_path / METRICS_FILENAME)
    assert [r.get("eval_loss") for r in rows] == [None, 2.5, 2.4]


def test_final_eval_after_the_last_step_completes_its_row(tmp_path, make_step):
    w = MetricsWriter(tmp_path)
    w.emit(make_step(1))
    w.emit(make_step(2))
    w.emit(EvalEvent(2, 2.25, math.exp(2.25)))  # the final eval comes after the last StepEvent
    w.emit(EvalEvent(2, 9.0, math.exp(9.0)))  # a second eval of the same step does not overwrite
    w.emit(make_step(3))
    w.close()
    rows = read_metrics(tmp_path / METRICS_FILENAME)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r.get("eval_loss") for r in rows] == [None, 2.25, None]
    assert rows[1]["loss"] == make_step(2).loss


def test_resume_appends_and_drops_rows_after_the_checkpoint(tmp_path, make_step):
    w = MetricsWriter(tmp_path)
    for s in range(1, 8):  # the first run logged 7 steps, then was killed
        w.emit(make_step(s, loss=10.0 + s))
    w.close()
    with (tmp_path / METRICS_FILENAME).open("a") as f:
        f.write('{"step": 8, "lo')  # torn line of a kill mid-write
    w2 = MetricsWriter(tmp_path)  # resumed from the checkpoint of step 5
    for s in range(6, 10):
        w2.emit(make_step(s, loss=20.0 + s))
    w2.close()
    rows = read_metrics(tmp_path / METRICS_FILENAME)
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["loss"] for r in rows] == [11, 12, 13, 14, 15, 26, 27, 28, 29]
    assert not (tmp_path / (METRICS_FILENAME + ".tmp")).exists()


def test_fresh_run_in_same_dir_starts_a_new_file(tmp_path, make_step):
    w = MetricsWriter(tmp_path)
    for s in (1, 2, 3):
        w.emit(make_step(s))
    w.close()
    w2 = MetricsWriter(tmp_path)
    w2.emit(make_step(1, loss=9.0))
    w2.close()
    rows = read_metrics(tmp_path / METRICS_FILENAME)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 9.0)]


def test_read_metrics_missing_file(tmp_path):
    assert read_metrics(tmp_path / "nope.jsonl") == []
