"""Number formatting: one spelling of bytes, durations, rates everywhere."""
from __future__ import annotations

import math

import pytest

from outcore.tui.format import (fmt_bytes, fmt_count, fmt_duration, fmt_float, fmt_gbps, fmt_lr,
                                fmt_percent, fmt_seconds, perplexity, sparkline)


@pytest.mark.parametrize("n, text", [
    (None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (100 * 1024 ** 2, "100 MiB"), (3 * 1024 ** 3 + 1024 ** 3 // 2, "3.5 GiB"),
    (-2048, "-2.0 KiB"), (5 * 1024 ** 5, "5.0 PiB"), (2048 * 1024 ** 5, "2048 PiB"),
])
def test_fmt_bytes(n, text):
    assert fmt_bytes(n) == text


@pytest.mark.parametrize("s, text", [
    (None, "-"), (float("nan"), "-"), (float("inf"), "-"), (-1, "-"), (0, "0:00"), (7.4, "0:07"),
    (723, "12:03"), (7210, "2:00:10"), (3 * 86400 + 4 * 3600, "3d 4:00:00"),
])
def test_fmt_duration(s, text):
    assert fmt_duration(s) == text


def test_small_formats():
    assert fmt_seconds(0.085) == "85 ms" and fmt_seconds(2.5) == "2.50 s" and fmt_seconds(725) == "12:05"
    assert fmt_gbps(2.153) == "2.15 GB/s" and fmt_gbps(0.64) == "640 MB/s" and fmt_gbps(None) == "-"
    assert fmt_gbps(0.0) == "0"
    assert fmt_count(12345.6) == "12,346" and fmt_count(3.14159) == "3.1"
    assert fmt_float(2.345678) == "2.3457" and fmt_float(None) == "-" and fmt_float(math.nan) == "nan"
    assert fmt_lr(5e-5) == "5.00e-05"
    assert fmt_percent(0.123) == "12%" and fmt_percent(0.0123) == "1.2%" and fmt_percent(None) == "-"


def test_perplexity_saturates():
    assert perplexity(None) is None
    assert perplexity(0.0) == 1.0
    assert perplexity(2.0) == pytest.approx(math.exp(2.0))
    assert perplexity(1e6) == math.inf and perplexity(math.nan) == math.inf


def test_perplexity_is_exp_until_a_float_overflows():
    """One perplexity for the views, the recipes' EvalEvents and ``outcore eval``: ``exp(loss)``
    with no cap inside the float's range (a cap would report a made-up number above it)."""
    from outcore import events

    assert perplexity is events.perplexity
    assert perplexity(60.0) == math.exp(60.0)  # not exp(50)
    assert perplexity(709.0) == math.exp(709.0)  # not inf: the double holds it
    assert perplexity(710.0) == math.inf  # past the double's range
    assert perplexity(math.inf) == math.inf


def test_sparkline_scales_min_to_max_and_keeps_newest():
    line = sparkline([0, 1, 2, 3, 4, 5, 6, 7])
    assert line == "▁▂▃▄▅▆▇█"
    assert sparkline(range(100), width=10) == sparkline(range(90, 100), width=10)
    assert len(sparkline(range(100), width=10)) == 10
    assert sparkline([None, math.nan, 1.0, 2.0]) == "▁█"  # gaps skipped
    assert sparkline([]) == "" and sparkline([2.0, 2.0, 2.0]) == "▄▄▄"


def test_sparkline_rejects_bad_width():
    with pytest.raises(ValueError, match="width=0"):
        sparkline([1.0], width=0)
