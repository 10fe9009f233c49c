"""The loss curve: a smoothed train-loss line over the raw one, eval loss as markers."""
from __future__ import annotations

import random

import pytest

from outcore.tui.plot import plot_loss_curve, smoothed


def test_smoothing_is_debiased_and_follows_the_trend():
    assert smoothed([(1, 3.0)]) == [(1, 3.0)]  # the first point is itself, not pulled to 0
    flat = smoothed([(s, 2.5) for s in range(1, 50)])
    assert all(abs(v - 2.5) < 1e-12 for _, v in flat)
    rng = random.Random(0)
    noisy = [(s, 4.0 - s / 100 + rng.gauss(0, 0.3)) for s in range(1, 201)]
    smooth = smoothed(noisy)
    assert [s for s, _ in smooth] == [s for s, _ in noisy]

    def roughness(points):  # mean absolute step-to-step change
        return sum(abs(b[1] - a[1]) for a, b in zip(points, points[1:])) / (len(points) - 1)
    assert roughness(smooth) < 0.25 * roughness(noisy)
    assert smooth[-1][1] == pytest.approx(2.0, abs=0.15)  # the trend's end, not the last sample's noise
    assert smoothed(noisy, weight=0.0) == noisy


@pytest.mark.parametrize("n", [3, 40])
def test_plot_writes_a_png(tmp_path, n):
    train = [(s, 3.0 - s / 50) for s in range(1, n + 1)]
    out = plot_loss_curve(train, [(0, 3.1), (n, 2.0)], tmp_path / "loss_curve.png", title="run")
    assert out.read_bytes()[:4] == b"\x89PNG"
