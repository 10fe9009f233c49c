"""Fixtures for the tui tests: event builders (no torch anywhere)."""
from __future__ import annotations

import math

import pytest

from outcore.events import EvalEvent, RunFinished, RunStarted, StepEvent, TierStats

GiB = 1 << 30


def _step(step: int, total: int = 10, loss: float | None = None, *, tiers: bool = False,
          device: bool = False, eval_loss: float | None = None, **kw) -> StepEvent:
    fields = dict(step=step, total_steps=total, loss=3.0 - 0.1 * step if loss is None else loss,
                  lr=1e-4, tokens_per_s=1500.0, step_s=0.5, elapsed_s=0.5 * step,
                  rss_bytes=3 * GiB, ram_bytes=24 * GiB, grad_norm=0.75, eval_loss=eval_loss,
                  stall_s=0.1)
    if device:
        fields.update(device_bytes=2 * GiB, device_total_bytes=8 * GiB)
    if tiers:
        fields["tiers"] = {
            "HOST": TierStats(held_bytes=5 * GiB, budget_bytes=8 * GiB, read_bytes=step * GiB,
                              written_bytes=step * 3 * (GiB // 4), read_gbps=6.0, write_gbps=5.5),
            "NVME": TierStats(held_bytes=12 * GiB, budget_bytes=0, read_bytes=step * 2 * GiB,
                              written_bytes=step * GiB, read_gbps=2.1, write_gbps=3.2),
        }
    fields.update(kw)
    return StepEvent(**fields)


@pytest.fixture
def make_step():
    """``make_step(step, total=10, loss=None, *, tiers=False, device=False, eval_loss=None, **fields)``."""
    return _step


@pytest.fixture
def run_events(tmp_path):
    """A whole short run (10 steps, evals at 0, 5 and 10) writing to ``tmp_path / 'run'``."""
    out = str(tmp_path / "run")

    def events(total: int = 10, first: int = 1, tiers: bool = False):
        evs = [RunStarted("test-run", "tiny-llama", 1_000_000, 250_000, total, out, "full", "adamw")]
        if first == 1:
            evs.append(EvalEvent(0, 3.5, math.exp(3.5)))
        for s in range(first, total + 1):
            ev_loss = 3.5 - 0.1 * s if s % 5 == 0 else None
            evs.append(_step(s, total, tiers=tiers, eval_loss=ev_loss))
            if ev_loss is not None:
                evs.append(EvalEvent(s, ev_loss, math.exp(ev_loss)))
        evs.append(RunFinished(total - first + 1, 5.0, 4 * GiB, out, 3.5, 2.5, False, out + "/final"))
        return evs

    return events


@pytest.fixture
def dashboard_text():
    """``dashboard_text(events, out) -> str``: the live dashboard as text after ``events`` (its
    run writing to ``out``), rendered 160 columns wide."""
    import io

    from rich.console import Console

    from outcore.tui import make_sink

    def render(events, out) -> str:
        sink = make_sink("rich", out, stream=io.StringIO())
        for ev in events:
            sink.emit(ev)
        console = Console(file=io.StringIO(), width=160, color_system=None)
        console.print(sink.view.render())
        sink.close()
        return console.file.getvalue()

    return render
