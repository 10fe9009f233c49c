"""SSD wear (training/wear.py): bytes written to the swap disk in the events and metrics rows,
equal to the store's counters; the TBW arithmetic; the ssd_tbw key and flag."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from outcore.errors import ConfigError
from outcore.events import RunFinished, StepEvent, TierStats
from outcore.offload.store import Tier, TierTraffic
from outcore.training.config import load_config
from outcore.training.wear import WearMeter, life_used_pct
from tests._helpers import RecordingSink


def _cfg(inputs: Path, out: Path, **kw):
    base = dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                max_steps=4, eval_every=0, eval_batches=1, lr=1e-3, warmup_steps=1, output=str(out),
                ui="none", val_fraction=0.1, offload="nvme")
    return load_config(overrides={**base, **kw})


# ---------------------------------------------------------------------------------
# arithmetic and config
# ---------------------------------------------------------------------------------
def test_life_share_is_bytes_over_the_rated_decimal_terabytes():
    assert life_used_pct(6 * 10**12, 600) == pytest.approx(1.0)
    assert life_used_pct(2 * 10**9, 600) == pytest.approx(100 * 2e9 / 600e12)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="ssd_tbw"):
            life_used_pct(1, bad)


@pytest.mark.parametrize("bad", ["-5", "nan", "inf", "lots"])
def test_bad_ssd_tbw_is_a_one_line_config_error(bad):
    with pytest.raises(ConfigError, match="ssd_tbw") as e:
        load_config(overrides={"ssd_tbw": bad})
    assert "\n" not in str(e.value)
    assert load_config(overrides={"ssd_tbw": "600"}).ssd_tbw == 600.0
    assert load_config().ssd_tbw == 0.0  # unknown: no life shares


def test_ssd_tbw_flag(capsys):
    from outcore.cli import main

    assert main(["finetune", "--ssd-tbw", "-1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("outcore: error: ssd_tbw=-1.0")
    assert main(["finetune", "--ssd-tbw", "600", "--dry-run"]) == 0
    assert "ssd_tbw: 600.0" in capsys.readouterr().out


class _Store:
    def __init__(self):
        self.traffic = TierTraffic()


def _step(step: int) -> StepEvent:
    return StepEvent(step=step, total_steps=10, loss=1.0, lr=1e-3, tokens_per_s=1.0, step_s=1.0,
                     elapsed_s=float(step), rss_bytes=1)


def test_meter_counts_swap_writes_and_new_checkpoints_on_the_same_disk(tmp_path):
    out, store = tmp_path / "run", _Store()
    old = out / "checkpoints" / "step_000002"  # a resumed run's checkpoint: not written by this run
    old.mkdir(parents=True)
    (old / "COMPLETE").write_bytes(b"x" * 10)
    store.traffic.wrote(Tier.NVME, 1000)  # the setup's initial placement
    meter = WearMeter(store, 600, out / "swap", out, step=2)
    store.traffic.moved(Tier.HOST, Tier.NVME, 300)
    store.traffic.moved(Tier.NVME, Tier.HOST, 5000)  # reads do not wear
    ev = meter.fill(_step(3))
    assert ev.ssd_written_bytes == 1300 and ev.ssd_written_per_step_bytes == 300
    assert ev.ssd_life_used_pct == pytest.approx(100 * 1300 / 600e12)
    assert ev.ssd_life_per_1000_steps_pct == pytest.approx(100 * 1000 * 300 / 600e12)
    new = out / "checkpoints" / "step_000004"
    new.mkdir()
    (new / "COMPLETE").write_bytes(b"y" * 40)
    (new / "tmp_not_complete").mkdir()
    store.traffic.moved(Tier.HOST, Tier.NVME, 300)
    store.traffic.moved(Tier.HOST, Tier.NVME, 300)
    ev = meter.fill(_step(5))
    assert ev.ssd_written_bytes == 1940 and ev.ssd_written_per_step_bytes == (600 + 40) / 2
    assert ev.ssd_life_per_1000_steps_pct == pytest.approx(100 * 1000 * 940 / 3 / 600e12)
    done = meter.fill(RunFinished(steps_done=5, wall_s=1.0, peak_rss_bytes=1, output_dir=str(out)))
    assert done.ssd_written_bytes == 1940
    assert done.ssd_life_per_1000_steps_pct == ev.ssd_life_per_1000_steps_pct  # the steps' projection


def test_meter_takes_the_swap_bytes_the_event_read(tmp_path):
    store = _Store()
    meter = WearMeter(store, 0, tmp_path / "swap", tmp_path, step=0)
    store.traffic.moved(Tier.HOST, Tier.NVME, 700)  # a write-back landing after the event read 500
    ev = _step(1)
    ev.tiers = {"NVME": TierStats(written_bytes=500)}
    assert meter.fill(ev).ssd_written_bytes == 500 and ev.ssd_written_per_step_bytes == 500
    done = meter.fill(RunFinished(steps_done=1, wall_s=1.0, peak_rss_bytes=1, output_dir=str(tmp_path)))
    assert done.ssd_written_bytes == 700  # the end reads the counters


def test_meter_without_rating_or_store(tmp_path):
    meter = WearMeter(None, 0, tmp_path / "swap", tmp_path, step=0)
    ev = meter.fill(_step(1))
    assert ev.ssd_written_bytes == 0 and ev.ssd_written_per_step_bytes == 0
    assert ev.ssd_life_used_pct is None and ev.ssd_life_per_1000_steps_pct is None


# ---------------------------------------------------------------------------------
# a real out-of-core run
# ---------------------------------------------------------------------------------
def _dir_bytes(d: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


@pytest.mark.slow(ci=True)
def test_out_of_core_run_reports_the_stores_writes(tiny_run_inputs, tmp_path):
    from outcore.recipes.full_finetune import finetune
    from outcore.tui.metrics import MetricsWriter, read_metrics

    sink, metrics = RecordingSink(), MetricsWriter()

    class _Both(RecordingSink):
        def emit(self, event):
            sink.emit(event)
            metrics.emit(event)

        def close(self):
            metrics.close()

    res = finetune(_cfg(tiny_run_inputs, tmp_path / "run", ssd_tbw=600), sink=_Both())
    steps = [e for e in sink.events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == [1, 2, 3, 4]
    for e in steps:  # no checkpoint during the steps: the swap file's writes, as the store counts them
        assert e.ssd_written_bytes == e.tiers["NVME"].written_bytes > 0
        assert e.ssd_life_used_pct == pytest.approx(100 * e.ssd_written_bytes / 600e12)
    for a, b in zip(steps, steps[1:]):
        assert b.ssd_written_per_step_bytes == b.ssd_written_bytes - a.ssd_written_bytes > 0
    setup = steps[0].ssd_written_bytes - steps[0].ssd_written_per_step_bytes
    assert 0 < setup < steps[0].ssd_written_bytes  # the initial placement is in the total, not the step
    last = steps[-1]
    assert last.ssd_life_per_1000_steps_pct == pytest.approx(
        100 * 1000 * (last.ssd_written_bytes - setup) / 4 / 600e12)
    # the end: the final flush, the checkpoint and the export, on the same disk as the swap dir
    done = sink.events[-1]
    assert isinstance(done, RunFinished)
    files = _dir_bytes(res.output_dir / "checkpoints" / "step_000004") + _dir_bytes(res.output_dir / "final")
    assert done.ssd_written_bytes >= last.ssd_written_bytes + files
    assert done.ssd_life_per_1000_steps_pct == last.ssd_life_per_1000_steps_pct
    rows = read_metrics(res.output_dir / "metrics.jsonl")
    for row, e in zip(rows, steps):
        assert row["ssd_written_bytes"] == e.ssd_written_bytes == row["tiers.NVME.written_bytes"]
        assert row["ssd_life_used_pct"] == e.ssd_life_used_pct
        assert math.isclose(row["ssd_written_per_step_bytes"], e.ssd_written_per_step_bytes)
    assert "ssd_life_per_1000_steps_pct" in rows[-1]


def test_zo_run_streaming_from_nvme_counts_its_writes(tiny_run_inputs, tmp_path):
    from outcore.recipes.zo_finetune import finetune as finetune_zo

    sink = RecordingSink()
    finetune_zo(_cfg(tiny_run_inputs, tmp_path / "zo", method="zo", optim="mezo", max_steps=3), sink=sink)
    steps = [e for e in sink.events if isinstance(e, StepEvent)]
    assert len(steps) == 3
    for e in steps:
        assert e.ssd_written_bytes == e.tiers["NVME"].written_bytes > 0
        assert e.ssd_life_used_pct is None  # no rating given
    assert all(e.ssd_written_per_step_bytes > 0 for e in steps[1:])
