"""Tokens per step and where the activations live, on every view that shows the run: the plain
header line, the dashboard and the summary; and the words for each activation policy."""
from __future__ import annotations

import io

import pytest

from outcore.activations.policy import ACTIVATION_POLICIES, activation_home
from outcore.events import RunFinished, RunStarted
from outcore.tui.plain import started_line
from outcore.tui.sinks import make_sink

GiB = 1 << 30
HOME = "block checkpoints on NVME (recompute_nvme)"


def _started(out: str, **kw) -> RunStarted:
    return RunStarted("r", "tiny", 1000, 1000, 2, out, "full", "adamw", **kw)


def test_activation_home_names_the_tier_of_every_policy():
    assert activation_home("recompute_nvme") == HOME
    assert activation_home("recompute_host") == "block checkpoints on HOST (recompute_host)"
    assert activation_home("recompute") == "block checkpoints on DEVICE (recompute)"
    assert activation_home("keep") == "activations kept on DEVICE (keep)"
    assert activation_home("offload") == "activations offloaded to NVME (offload)"
    assert "first training step" in activation_home("auto")
    for policy in ACTIVATION_POLICIES:  # every run-level name has its words
        assert activation_home(policy)


def test_plain_header_line_shows_them_when_known():
    line = started_line(_started("/tmp/x", tokens_per_step=16384, activations=HOME))
    assert f"| 16,384 tokens/step | activations: {HOME} -> /tmp/x" in line
    bare = started_line(_started("/tmp/x"))
    assert "tokens/step" not in bare and "activations" not in bare


def test_dashboard_has_a_context_row(tmp_path, make_step, dashboard_text):
    out = str(tmp_path / "run")
    text = dashboard_text([_started(out, tokens_per_step=16384, activations=HOME), make_step(1, total=2)], out)
    assert f"context  16,384 tokens/step   {HOME}" in text
    bare = dashboard_text([_started(out), make_step(1, total=2)], out)
    assert "context" not in bare and "tokens/step" not in bare


@pytest.mark.parametrize("known", [True, False])
def test_summary_rows(tmp_path, make_step, known):
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)
    out = str(tmp_path / "run")
    sink.emit(_started(out, **(dict(tokens_per_step=512, activations=HOME) if known else {})))
    sink.emit(make_step(1, total=1))
    sink.emit(RunFinished(1, 2.0, GiB, out))
    sink.close()
    text = stream.getvalue()
    summary = text[text.index("step 1/1"):]  # after the header line
    assert ("tokens/step  512" in summary and f"activations  {HOME}" in summary) == known
    assert sink.summary.tokens_per_step == (512 if known else None)
    assert sink.summary.activations == (HOME if known else None)
