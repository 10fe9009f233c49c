"""SSD wear on every view: the plain line, the dashboard, metrics rows and the summary."""
from __future__ import annotations

import io

from rich.console import Console

from outcore.events import RunFinished, RunStarted
from outcore.tui.dashboard import Dashboard
from outcore.tui.metrics import step_row
from outcore.tui.plain import step_line
from outcore.tui.sinks import make_sink
from outcore.tui.summary import wear_text

GiB, MiB = 1 << 30, 1 << 20
WEAR = dict(ssd_written_bytes=3 * GiB, ssd_written_per_step_bytes=512 * MiB, ssd_life_used_pct=0.000537,
            ssd_life_per_1000_steps_pct=0.0895)


def test_wear_text():
    assert wear_text(None, None, None, None) is None
    assert wear_text(3 * GiB, 512 * MiB, None, None) == "3.0 GiB, 512 MiB/step"
    assert wear_text(3 * GiB, None, 0.000537, 0.0895) == \
        "3.0 GiB; 0.000537% of rated life, 0.0895% per 1000 steps"


def test_plain_line_shows_the_bytes_written_and_the_life_share(make_step):
    line = step_line(make_step(3, total=40, **WEAR))
    assert line.endswith("ssd 3.0 GiB, 512 MiB/step; 0.000537% of rated life, 0.0895% per 1000 steps")
    assert "ssd" not in step_line(make_step(3, total=40))  # not measured: nothing said


def test_metrics_row_carries_the_fields(make_step):
    row = step_row(make_step(3, total=40, **WEAR))
    assert {k: row[k] for k in WEAR} == WEAR
    assert not any(k.startswith("ssd_") for k in step_row(make_step(3, total=40)))


def test_dashboard_has_an_ssd_row(make_step):
    console = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    dash = Dashboard(console, live=False)
    dash.emit(RunStarted("demo", "tiny", 1000, 1000, 40, "/tmp/out", "full", "adamw"))
    dash.emit(make_step(3, total=40, **WEAR))
    console.print(dash.render())
    text = console.file.getvalue()
    assert "ssd" in text and "3.0 GiB, 512 MiB/step; 0.000537% of rated life" in text


def test_summary_row(tmp_path, make_step):
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)
    out = str(tmp_path / "run")
    sink.emit(RunStarted("r", "tiny", 1000, 1000, 1, out, "full", "adamw"))
    sink.emit(make_step(1, total=1, **WEAR))
    sink.emit(RunFinished(1, 2.0, GiB, out, ssd_written_bytes=4 * GiB, ssd_life_used_pct=0.000716,
                          ssd_life_per_1000_steps_pct=0.0895))
    sink.close()
    assert "SSD written  4.0 GiB; 0.000716% of rated life, 0.0895% per 1000 steps" in stream.getvalue()
    assert sink.summary.ssd_written_bytes == 4 * GiB


def test_summary_states_a_typical_drive_without_a_rating(tmp_path, make_step):
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)
    out = str(tmp_path / "run")
    sink.emit(RunStarted("r", "tiny", 1000, 1000, 1, out, "full", "adamw"))
    sink.emit(make_step(1, total=1))
    sink.emit(RunFinished(1, 2.0, GiB, out, ssd_written_bytes=20 * 10**9))  # no --ssd-tbw
    sink.close()
    # 20 GB of a 600 TB rating: 0.0033%
    assert "SSD written  18.6 GiB; 0.0033% of a typical 1 TB drive's rated life (600 TBW; --ssd-tbw" in \
        stream.getvalue()
