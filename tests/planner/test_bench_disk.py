"""scripts/bench_step.py --regime disk: the disk-limited time, the disk model, the summary's figures."""
from __future__ import annotations

import sys

import pytest

from tests._helpers import ROOT, load_module

SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def disk():
    sys.path.insert(0, str(SCRIPTS))  # the script's own siblings (_measure, bench_io) import by name
    return load_module(SCRIPTS / "_bench_disk.py")


def test_disk_limited_time_is_the_sum_on_a_shared_disk_and_the_max_on_a_concurrent_one(disk):
    # 4 GB read at 2 GB/s (2 s), 3 GB written at 1.5 GB/s (2 s)
    assert disk.disk_limited_s(4 * 10**9, 3 * 10**9, 2.0, 1.5, "serial") == pytest.approx(4.0)
    assert disk.disk_limited_s(4 * 10**9, 3 * 10**9, 2.0, 1.5, "concurrent") == pytest.approx(2.0)
    assert disk.disk_limited_s(0, 3 * 10**9, 2.0, 1.5, "serial") == pytest.approx(2.0)


@pytest.mark.parametrize("together,expected", [(2.9, "serial"), (2.6, "serial"), (2.4, "concurrent"),
                                               (2.0, "concurrent"), (3.5, "serial")])
def test_disk_model_follows_what_running_both_at_once_saved(disk, together, expected):
    # alone one after the other: 3 s; the longer alone: 2 s; at once saves up to 1 s
    assert disk.disk_model(3.0, together, 2.0) == expected


def _row(step, read, written, together, load=1.0):
    return {"step_s": step, "loss": 1.0, "read_bytes": read, "write_bytes": written, "stall_s": 0.1,
            "load_1m": load, "read_gbps": 2.0, "write_gbps": 1.0, "alone_s": 3.0, "together_s": together,
            "parallel_s": 2.0}


def test_summary_sets_the_median_step_against_the_median_disk_limit(disk):
    rows = [_row(5.0, 4 * 10**9, 10**9, 2.9), _row(6.0, 4 * 10**9, 10**9, 2.8), _row(9.0, 4 * 10**9, 10**9, 2.1)]
    s = disk.summarize(rows)
    assert s["disk_model"] == "serial"  # two rounds of three saved little
    assert s["disk_limited_s"] == pytest.approx(2.0 + 1.0)
    assert s["median_step_s"] == 6.0 and (s["min_step_s"], s["max_step_s"]) == (5.0, 9.0)
    assert s["ratio"] == pytest.approx(2.0)
    assert (s["bytes_read_per_step"], s["bytes_written_per_step"]) == (4 * 10**9, 10**9)
    assert s["disk_concurrent_saving"] == pytest.approx(1 - 2.8 / 3.0)
    assert s["load_1m"] == [1.0, 1.0, 1.0] and len(s["steps"]) == 3


def test_disk_regime_defaults_to_the_disk_bound_shape():
    sys.path.insert(0, str(SCRIPTS))
    bench = load_module(SCRIPTS / "bench_step.py")
    a = bench.parse_args(["--regime", "disk", "--layers", "2"])
    assert (a.seq, a.batch, a.layers) == (32, 1, 2)
    b = bench.parse_args([])
    assert (b.seq, b.batch, b.regime) == (256, 2, "step")
    assert bench.model_config("smol-1.7b-random", 3).num_hidden_layers == 3
    assert bench.model_config("smol-1.7b-random").num_hidden_layers == 24
