"""The rich dashboard: what it shows, and that the trainer never waits on it."""
from __future__ import annotations

import io
import math
import threading
import time

from rich.console import Console

from outcore.events import EvalEvent, RunFinished, RunStarted
from outcore.tui.dashboard import Dashboard


def _console(width: int = 120) -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)


def _text(dash: Dashboard, width: int = 120) -> str:
    c = _console(width)
    c.print(dash.render())
    return c.file.getvalue()


def _started(total: int = 10) -> RunStarted:
    return RunStarted("demo", "SmolLM2-135M", 134_500_000, 134_500_000, total, "/tmp/out", "full", "adamw")


def test_main_panel_shows_progress_loss_speed_memory(make_step):
    dash = Dashboard(_console(), live=False)
    dash.emit(_started(40))
    dash.emit(EvalEvent(0, 3.2, math.exp(3.2)))
    for s in range(1, 13):
        dash.emit(make_step(s, total=40, eval_loss=2.5 if s == 10 else None))
    text = _text(dash)
    assert "outcore demo" in text and "training" in text
    assert "12/40" in text and "30%" in text
    assert "ETA 0:14" in text  # 28 steps left at 0.5 s/step
    assert "loss" in text and "1.8000" in text  # the last loss
    assert "eval 2.5000" in text and "ppl 12.18" in text and "@10" in text
    assert any(ch in text for ch in "▁▂▃▄▅▆▇█")  # the sparkline
    assert "1,500 tokens/s" in text and "500 ms/step" in text
    assert "lr 1.00e-04" in text and "grad norm 0.750" in text
    assert "3.0 GiB / 24.0 GiB RAM" in text and "(12%)" in text
    assert "device" not in text  # no device on this run
    assert "tiers" not in text  # no tier panel without tiers


def test_device_memory_and_tier_panel_when_present(make_step):
    dash = Dashboard(_console(), live=False)
    dash.emit(_started())
    dash.emit(make_step(1, tiers=True, device=True))
    dash.emit(make_step(2, tiers=True, device=True))
    text = _text(dash)
    assert "device" in text and "2.0 GiB / 8.0 GiB" in text
    dash.emit(make_step(3, grad_norm=None))  # a zeroth-order run: no gradient, no grad norm
    assert "grad norm" not in _text(dash)
    assert "I/O stall 20% of the step" in text
    lines = {line.split()[1]: line for line in text.splitlines() if line.split()[1:2] in (["HOST"], ["NVME"])}
    host, nvme = lines["HOST"], lines["NVME"]
    assert "5.0 GiB / 8.0 GiB" in host and "6.00 GB/s" in host and "5.50 GB/s" in host
    assert "768 MiB" in host  # written per step (3/4 GiB)
    assert "1.5 GiB" in host  # written so far at step 2
    assert "12.0 GiB / unbounded" in nvme and "2.10 GB/s" in nvme and "3.20 GB/s" in nvme
    assert "2.0 GiB" in nvme  # read per step
    assert text.index("HOST") < text.index("NVME")


def test_finished_and_interrupted_titles(make_step):
    dash = Dashboard(_console(), live=False)
    dash.emit(_started())
    dash.emit(make_step(1))
    dash.emit(RunFinished(1, 1.0, 1, "/tmp/out", interrupted=True))
    assert "interrupted" in _text(dash)
    dash2 = Dashboard(_console(), live=False)
    dash2.emit(RunFinished(10, 1.0, 1, "/tmp/out"))
    assert "finished" in _text(dash2)


def test_waiting_before_first_step_and_narrow_terminal(make_step):
    dash = Dashboard(_console(80), live=False)
    dash.emit(_started())
    dash.emit(EvalEvent(0, 3.0, math.exp(3.0)))  # the base model's eval comes before step 1
    text = _text(dash, 80)
    assert "waiting for the first step" in text and "eval 3.0000" in text and "@0" in text
    dash.emit(make_step(1, tiers=True, device=True))
    text = _text(dash, 80)
    assert "…" not in text  # every column fits without being cut
    assert "rd GB/s" in text and "HOST" in text and "12.0 GiB / ∞" in text


def test_live_run_draws_and_closes(make_step, run_events):
    console = _console()
    dash = Dashboard(console, refresh_per_second=20)
    for ev in run_events()[:-1]:
        dash.emit(ev)
    time.sleep(0.2)  # let the refresh thread draw
    dash.emit(run_events()[-1])
    dash.close()
    dash.close()
    out = console.file.getvalue()
    assert "10/10" in out and "finished" in out
    assert "test-run" in out and "tiny-llama" in out  # the header line


def test_emit_never_waits_on_a_slow_render(make_step):
    """A terminal that takes 0.3 s per draw must not slow the trainer's emit calls."""
    dash = Dashboard(_console(), refresh_per_second=20)
    render = dash.render
    drawing = threading.Event()

    def slow_render():
        drawing.set()
        time.sleep(0.3)
        return render()

    dash.render = slow_render  # Live calls this on its refresh thread
    dash.emit(_started(500))
    assert drawing.wait(2.0)  # a draw is in progress now
    t0 = time.perf_counter()
    for s in range(1, 501):
        dash.emit(make_step(s, total=500))
    elapsed = time.perf_counter() - t0
    dash.close()
    assert elapsed < 0.25, f"500 emits took {elapsed:.3f} s while a draw was in progress"
