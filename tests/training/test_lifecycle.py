"""The run lifecycle (training/lifecycle.py) around a recipe that trains nothing: the order of
its calls and events, the cadences, signals at step boundaries, failures, the lock."""
from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch

from outcore.errors import ConfigError, Interrupted
from outcore.training import lifecycle
from outcore.training.config import FinetuneConfig
from outcore.training.lifecycle import Built, Evaluation, Run, Stepped
from outcore.training.output_dir import prepare_output_dir


class _Sink:
    def __init__(self):
        self.events, self.closed = [], 0

    def emit(self, event):
        self.events.append(event)

    def close(self):
        self.closed += 1

    def kinds(self):
        return [type(e).__name__ for e in self.events]


class _Recipe:
    """Records the lifecycle's calls; ``signal_at`` / ``fail_at`` stop or break the run there."""

    def __init__(self, run: Run, signal_at: int = 0, fail_in: str = "", checkpointed: bool = False,
                 loss: float = 1.0):
        self.run, self.calls = run, []
        self.signal_at, self.fail_in, self.checkpointed, self.loss = signal_at, fail_in, checkpointed, loss

    def _call(self, name):
        self.calls.append(name)
        if self.fail_in == name:
            raise RuntimeError(f"{name} failed")

    def setup(self):
        self._call("setup")
        return Built(n_params=10, n_trainable=5, tokens_per_step=8)

    def step(self, lr):
        self._call(f"step {self.run.step + 1}")
        if self.run.step + 1 == self.signal_at:
            self.run.stop.signum = signal.SIGTERM  # what the handler notes while the step runs
        return Stepped(torch.tensor(self.loss), checkpointed=self.checkpointed)

    def evaluate(self, step):
        self._call(f"eval {step}")
        return Evaluation(2.0)

    def save(self):
        self._call(f"save {self.run.step}")

    def export(self, out_dir):
        self._call("export")
        return out_dir

    def close(self, completed):
        self._call(f"close {completed}")


def _run(tmp_path, sink=None, **kw) -> Run:
    base = dict(output=str(tmp_path / "run"), max_steps=4, eval_every=2, save_every=3, log_every=1, threads=1,
                offload="none", device="cpu")
    return Run(FinetuneConfig(**{**base, **kw}), sink)


def test_a_run_calls_its_recipe_in_order_with_the_cadences(tmp_path):
    sink, made = _Sink(), []
    run = _run(tmp_path, sink)
    result = run.execute(lambda r: made.append(_Recipe(r)) or made[0])
    assert made[0].calls == ["setup", "eval 0", "step 1", "step 2", "eval 2", "step 3", "save 3", "step 4",
                             "eval 4", "save 4", "export", "close True"]
    assert sink.kinds() == ["RunStarted", "EvalEvent", "StepEvent", "EvalEvent", "StepEvent", "StepEvent",
                            "StepEvent", "EvalEvent", "RunFinished"]  # step 2's eval fills its line
    assert sink.closed == 1 and run.out_lock is None
    assert result.steps_done == 4 and result.losses == [1.0] * 4 and not result.interrupted
    assert result.base_eval_loss == result.final_eval_loss == 2.0 and result.final_dir == run.out / "final"
    assert (run.out / "config.yaml").is_file()


def test_a_signal_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
    sink, made = _Sink(), []
    run = _run(tmp_path, sink, save_every=0, eval_every=0)
    with pytest.raises(Interrupted) as stop:
        run.execute(lambda r: made.append(_Recipe(r, signal_at=2)) or made[0])
    assert made[0].calls[-3:] == ["step 2", "save 2", "close False"]  # the step whole, then saved
    assert stop.value.step == 2 and stop.value.output == str(run.out)
    assert sink.events[-1].interrupted and sink.events[-1].steps_done == 2 and sink.closed == 1


def test_a_recent_checkpoint_is_not_written_again(tmp_path):
    made = []
    run = _run(tmp_path, save_every=2, eval_every=0)
    with pytest.raises(Interrupted) as stop:
        run.execute(lambda r: made.append(_Recipe(r, signal_at=3)) or made[0])
    assert made[0].calls[-3:] == ["save 2", "step 3", "close False"]  # step 2's is seconds old
    assert stop.value.step == 2 and lifecycle.RECENT_CHECKPOINT_S >= 1


def test_a_step_that_is_its_checkpoint_needs_no_save(tmp_path):
    made = []
    run = _run(tmp_path, save_every=0, eval_every=0)
    with pytest.raises(Interrupted) as stop:
        run.execute(lambda r: made.append(_Recipe(r, signal_at=1, checkpointed=True)) or made[0])
    assert made[0].calls == ["setup", "eval 0", "step 1", "close False"]
    assert stop.value.step == 1 and stop.value.output == str(run.out)


@pytest.mark.parametrize("where", ["setup", "step 2", "export"])
def test_a_failure_closes_the_recipe_and_the_sink_and_reports_nothing(tmp_path, where):
    sink, made = _Sink(), []
    run = _run(tmp_path, sink)
    with pytest.raises(RuntimeError, match=f"{where} failed"):
        run.execute(lambda r: made.append(_Recipe(r, fail_in=where)) or made[0])
    assert made[0].calls[-1] == "close False" and made[0].calls.count("close False") == 1
    assert "RunFinished" not in sink.kinds() and sink.closed == 1
    _, lock = prepare_output_dir(FinetuneConfig(output=str(run.out), overwrite=True))  # the lock is free
    os.close(lock)


def test_a_recipe_that_refuses_its_config_fails_before_any_work(tmp_path):
    sink = _Sink()

    def refuse(run):
        raise ConfigError("no")

    with pytest.raises(ConfigError):
        _run(tmp_path, sink).execute(refuse)
    assert sink.closed == 1 and not (tmp_path / "run").exists()


def test_a_non_finite_loss_stops_the_run(tmp_path):
    made = []
    with pytest.raises(FloatingPointError, match="loss became nan at step 1"):
        _run(tmp_path).execute(lambda r: made.append(_Recipe(r, loss=math.nan)) or made[0])
    assert made[0].calls[-1] == "close False"


def test_a_resumed_run_continues_from_its_checkpoint(tmp_path):
    class Resumed(_Recipe):
        def setup(self):
            self._call("setup")
            return Built(10, 5, 8, checkpoint_step=3, base_eval_loss=1.5)

    made = []
    prepare = _run(tmp_path)
    prepare.execute(_Recipe)  # a run to resume
    run = _run(tmp_path, resume=str(Path(prepare.out)))
    result = run.execute(lambda r: made.append(Resumed(r)) or made[0])
    assert made[0].calls == ["setup", "step 4", "eval 4", "save 4", "export", "close True"]  # no base eval
    assert result.base_eval_loss == 1.5 and result.steps_done == 4
