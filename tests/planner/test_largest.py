"""The largest full fine-tune a swap disk holds (``planner/largest.py``): the plan's own sizes,
4 B per parameter in the write-lean mode, and the shape named from a free-space figure."""
from __future__ import annotations

import pytest

from outcore.planner.largest import HEADROOM, REFERENCE_SHAPES, largest_full_finetune, swap_bytes_per_shape

GB = 10**9


def test_the_write_lean_mode_needs_4_bytes_a_parameter_and_exact_needs_more():
    lean = swap_bytes_per_shape(layers=2)
    assert sorted(f.shape for f in lean) == sorted(REFERENCE_SHAPES)
    for f in lean:  # bf16 weight + 8-bit moments; their scales (and norms' moments) stay in RAM
        assert 3.99 * f.params <= f.swap_bytes < 4.01 * f.params, f
    exact = {f.shape: f.swap_bytes for f in swap_bytes_per_shape(precision="exact", layers=2)}
    kept = {f.shape: f.swap_bytes for f in swap_bytes_per_shape(grads_kept=True, layers=2)}
    for f in lean:  # an fp32 master (4 B); spilled bf16 gradients (2 B)
        assert exact[f.shape] >= f.swap_bytes + 4 * f.params and kept[f.shape] >= f.swap_bytes + 2 * f.params


@pytest.mark.parametrize("free_gb, want", [(5, None), (40, "llama3-8b"), (70, "14b"), (400, "llama3-70b")])
def test_the_largest_shape_that_fits_the_free_space_less_headroom(free_gb, want):
    fit = largest_full_finetune(free_gb * GB)
    assert (fit.shape if fit else None) == want
    if fit:
        assert fit.swap_bytes <= free_gb * GB * (1 - HEADROOM)


def test_a_shape_that_fits_only_without_headroom_is_not_named():
    need = {f.shape: f.swap_bytes for f in swap_bytes_per_shape()}["14b"]
    assert largest_full_finetune(need).shape == "llama3-8b"
    assert largest_full_finetune(int(need / (1 - HEADROOM)) + 1).shape == "14b"
