"""make_sink: the view choice, the fan-out to metrics.jsonl, the loss curve and the summary."""
from __future__ import annotations

import io
import math

import pytest

from outcore.errors import ConfigError
from outcore.events import RunFinished, RunStarted
from outcore.tui import make_sink, resolve_ui
from outcore.tui.dashboard import Dashboard
from outcore.tui.metrics import read_metrics
from outcore.tui.plain import PlainView
from outcore.tui.sinks import NullView, RunSink

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_resolve_ui(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert resolve_ui("auto", _Tty()) == "rich"
    assert resolve_ui("auto", io.StringIO()) == "plain"  # a pipe / a file / a notebook
    monkeypatch.setenv("CI", "true")
    assert resolve_ui("auto", _Tty()) == "plain"
    for mode in ("rich", "plain", "none"):
        assert resolve_ui(mode, io.StringIO()) == mode


def test_bad_ui_names_the_value():
    with pytest.raises(ConfigError, match=r"ui='fancy' is not one of: auto, rich, plain, none"):
        make_sink("fancy")


def test_make_sink_picks_the_view(tmp_path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert isinstance(make_sink("plain", tmp_path, stream=io.StringIO()).view, PlainView)
    assert isinstance(make_sink("none", tmp_path).view, NullView)
    assert isinstance(make_sink("rich", tmp_path, stream=io.StringIO()).view, Dashboard)
    assert isinstance(make_sink("auto", tmp_path, stream=_Tty()).view, Dashboard)


def test_plain_run_writes_metrics_plot_and_summary(tmp_path, run_events):
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)  # output dir taken from RunStarted
    for ev in run_events():
        sink.emit(ev)
    sink.close()
    sink.close()
    out = tmp_path / "run"
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["step"] for r in rows if "eval_loss" in r] == [5, 10]
    png = (out / "loss_curve.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    text = stream.getvalue()
    assert "step  1/10" in text and "step 10/10" in text
    assert "eval @ step 5: loss 3.0000" in text
    assert f"base {math.exp(3.5):.2f} -> final {math.exp(2.5):.2f}" in text
    assert "peak RSS" in text and "4.0 GiB of 24.0 GiB RAM" in text
    assert str(out / "loss_curve.png") in text and str(out / "metrics.jsonl") in text
    assert str(out / "final") in text
    s = sink.summary
    assert s is not None and s.steps_done == 10 and s.final_perplexity == pytest.approx(math.exp(2.5))


def test_none_ui_still_writes_files_and_prints_nothing(tmp_path, run_events, capsys):
    sink = make_sink("none", tmp_path / "run")
    for ev in run_events():
        sink.emit(ev)
    sink.close()
    assert capsys.readouterr().out == ""
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 10
    assert (tmp_path / "run" / "loss_curve.png").is_file()


def test_resumed_run_plots_and_keeps_full_history(tmp_path, run_events):
    evs = run_events()
    first = make_sink("none", tmp_path / "run")
    for ev in evs[:8]:  # started, base eval, steps 1..5 (+ eval at 5), then killed: no RunFinished
        first.emit(ev)
    first.close()
    second = make_sink("none", tmp_path / "run")
    for ev in run_events(first=4):  # resumed from the checkpoint of step 3
        second.emit(ev)
    second.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert (tmp_path / "run" / "loss_curve.png").is_file()


def test_interrupted_before_first_step_has_no_plot(tmp_path):
    stream = io.StringIO()
    sink = make_sink("plain", tmp_path, stream=stream)
    sink.emit(RunStarted("r", "m", 10, 10, 5, str(tmp_path)))
    sink.emit(RunFinished(0, 0.5, 1 << 30, str(tmp_path), base_eval_loss=2.0, interrupted=True))
    sink.close()
    assert not (tmp_path / "loss_curve.png").exists()
    text = stream.getvalue()
    assert "run interrupted" in text and "(interrupted)" in text
    assert f"base {math.exp(2.0):.2f} (no final eval)" in text
    assert "resume with" not in text  # no checkpoint to resume from


def test_interrupted_run_with_checkpoints_says_how_to_resume(tmp_path, make_step):
    (tmp_path / "checkpoints").mkdir()
    stream = io.StringIO()
    sink = make_sink("plain", tmp_path, stream=stream)
    sink.emit(make_step(1))
    sink.emit(RunFinished(1, 0.5, 1 << 30, str(tmp_path), interrupted=True))
    sink.close()
    assert f"outcore finetune --resume {tmp_path}" in stream.getvalue()


def test_metrics_row_is_written_before_the_view_fails(tmp_path, make_step):
    class Broken(NullView):
        def emit(self, event):
            raise RuntimeError("view broke")

    sink = RunSink(Broken(), tmp_path)
    with pytest.raises(RuntimeError):
        sink.emit(make_step(1))
    sink.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
