"""Plain log lines (CI, pipes, notebooks)."""
from __future__ import annotations

import io

from outcore.events import EvalEvent, RunStarted
from outcore.tui.plain import PlainView, eval_line, started_line, step_line
from outcore.tui.state import RunState


def test_step_line_fields(make_step):
    line = step_line(make_step(3, total=40, eval_loss=2.5, device=True))
    assert line.startswith("step  3/40 | loss 2.7000 | eval 2.5000 | lr 1.00e-04 | gnorm 0.750")
    assert "1,500 tok/s" in line and "500 ms/step" in line and "rss 3.0 GiB" in line
    assert "dev 2.0 GiB" in line and "nvme" not in line and "stall" not in line
    assert "\n" not in line


def test_step_line_tiers_stall_and_eta(make_step):
    state = RunState()
    state.update(make_step(1, total=10))
    ev = make_step(2, total=10, tiers=True)
    state.update(ev)
    line = step_line(ev, state)
    assert "host 5.0 GiB r 6.00 GB/s w 5.50 GB/s" in line
    assert "nvme 12.0 GiB r 2.10 GB/s w 3.20 GB/s" in line
    assert "stall 20%" in line  # 0.1 s of a 0.5 s step
    assert line.endswith("eta 0:04")  # 8 steps left at 0.5 s


def test_view_prints_header_plan_steps_evals(make_step):
    out = io.StringIO()
    view = PlainView(out)
    view.emit(RunStarted("r1", "tiny", 2_500_000, 1_000_000, 4, "/tmp/x", "lora", "adamw",
                         plan_table="PLAN TABLE"))
    view.emit(make_step(1, total=4))
    view.emit(EvalEvent(1, 2.0, 7.389))
    view.close()
    view.emit(make_step(2, total=4))  # after close: silent
    lines = out.getvalue().splitlines()
    assert lines[0] == started_line(RunStarted("r1", "tiny", 2_500_000, 1_000_000, 4, "/tmp/x", "lora", "adamw"))
    assert "2.5M params, 1.0M trainable" in lines[0] and "lora/adamw" in lines[0]
    assert lines[1] == "PLAN TABLE"
    assert lines[2].startswith("step 1/4")
    assert lines[3] == eval_line(EvalEvent(1, 2.0, 7.389)) == "eval @ step 1: loss 2.0000, perplexity 7.39"
    assert len(lines) == 4
