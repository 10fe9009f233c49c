"""A torchrun restart continues the run its own launch wrote, and only that one."""
from __future__ import annotations

import pytest

from outcore.training.config import load_config
from outcore.training.distributed.elastic import LAUNCH_MARKER, continue_after_restart, launch_id, mark_launch


@pytest.fixture
def restarted(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")


def _run_dir(tmp_path, checkpoint: bool):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "config.yaml").write_text("{}")
    if checkpoint:  # a complete checkpoint: its directory and the COMPLETE marker
        step = out / "checkpoints" / "step_000002"
        step.mkdir()
        (step / "COMPLETE").write_text("{}")
    return out


def test_outside_torchrun_nothing_is_marked_or_continued(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    out = _run_dir(tmp_path, checkpoint=True)
    mark_launch(out)
    assert launch_id() is None and not (out / LAUNCH_MARKER).exists()
    cfg = load_config(overrides={"output": str(out)})
    assert continue_after_restart(cfg, out) is None and cfg.resume is None and not cfg.overwrite


@pytest.mark.parametrize("checkpoint,expect", [(True, "continuing from step_000002"),
                                               (False, "no complete checkpoint yet: starting over")])
def test_a_restart_of_the_same_launch_continues_or_starts_over(tmp_path, restarted, checkpoint, expect):
    out = _run_dir(tmp_path, checkpoint)
    mark_launch(out)
    cfg = load_config(overrides={"output": str(out)})
    assert continue_after_restart(cfg, out) == f"outcore: torchrun restart 1 of 3: {expect} in {out}"
    assert (cfg.resume, cfg.overwrite) == ((str(out), False) if checkpoint else (None, True))


def test_a_restart_never_takes_over_another_launch_s_run(tmp_path, restarted):
    out = _run_dir(tmp_path, checkpoint=True)
    (out / LAUNCH_MARKER).write_text("another-host 4242 1700000000.000 ")
    cfg = load_config(overrides={"output": str(out)})
    assert continue_after_restart(cfg, out) is None and cfg.resume is None and not cfg.overwrite
    (out / LAUNCH_MARKER).unlink()  # a run written outside torchrun: no marker
    assert continue_after_restart(cfg, out) is None and not cfg.overwrite


def test_the_first_attempt_and_an_explicit_choice_are_left_alone(tmp_path, monkeypatch):
    out = _run_dir(tmp_path, checkpoint=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    mark_launch(out)
    cfg = load_config(overrides={"output": str(out)})
    assert continue_after_restart(cfg, out) is None and cfg.resume is None  # attempt 0: the usual checks
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    cfg = load_config(overrides={"output": str(out), "overwrite": True})
    assert continue_after_restart(cfg, out) is None and cfg.resume is None  # the user's --overwrite stands
