"""FRUGAL's C++ step (csrc/frugal_cpu.h) against its reference, bit for bit."""
from __future__ import annotations

import pytest
import torch

from outcore.kernels.adamw8bit import coefficients
from outcore.kernels.cpu_ext import supported_isa_levels
from outcore.kernels.frugal import frugal_update_, frugal_update_ref_
from outcore.optim.frugal import subspace_columns
from tests._helpers import needs_cpu_extension


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _inputs(rows: int, n: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(rows, n, generator=g) * 0.02
    p.view(-1)[::17] = 0.0  # zero weights and gradients: sign 0, -0 + 0
    grads = []
    for t in range(3):
        gr = torch.randn(rows, n, generator=g) * 10.0 ** -(t + 2)
        gr.view(-1)[t::11] = 0.0
        gr.view(-1)[t + 5::23] = -0.0
        grads.append(gr)
    return p, grads


def _run(fn, rows: int, n: int, k: int, wd: float) -> tuple[torch.Tensor, ...]:
    p, grads = _inputs(rows, n, seed=rows + n)
    p0 = p.clone()
    m, v = torch.zeros(rows, k), torch.zeros(rows, k)
    for t, gr in enumerate(grads):  # a new column set each step
        cols = subspace_columns(n, k, seed=t, device=p.device)
        fn(p, gr, cols, m, v, coefficients(1e-2, 0.9, 0.999, 1e-8, wd, t + 1), -1e-2 * 0.5)
    assert not torch.equal(p, p0)
    return p, m, v


def _assert_same_bits(got, want, what="") -> None:
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b)), what


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,n,k,wd", [(16, 40, 10, 0.1), (37, 1000, 250, 0.0), (3, 5, 5, 0.1),
                                          (300, 300, 1, 0.0)])
def test_cpp_equals_reference(threads, rows, n, k, wd):
    needs_cpu_extension()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_same_bits(_run(frugal_update_, rows, n, k, wd), _run(frugal_update_ref_, rows, n, k, wd))
    finally:
        torch.set_num_threads(old)


@pytest.mark.slow(ci=True)  # builds each level's extension once (shared with the AdamW8bit tests)
def test_every_isa_level_equals_reference(monkeypatch):
    needs_cpu_extension("DEFAULT")
    want = _run(frugal_update_ref_, 37, 1000, 250, 0.1)
    for isa in supported_isa_levels():
        monkeypatch.setenv("OUTCORE_CPU_ISA", isa)
        _assert_same_bits(_run(frugal_update_, 37, 1000, 250, 0.1), want, isa)


def test_cols_must_be_sorted_distinct_in_range():
    ext = needs_cpu_extension()
    p, g, m, v = torch.zeros(2, 8), torch.ones(2, 8), torch.zeros(2, 2), torch.zeros(2, 2)
    c = list(coefficients(1e-2, 0.9, 0.999, 1e-8, 0.0, 1))
    for bad in ([3, 1], [2, 2], [7, 8]):
        with pytest.raises(RuntimeError, match="cols must be sorted distinct columns"):
            ext.frugal_update(p, g, torch.tensor(bad), m, v, c, -1e-2)
    assert torch.equal(p, torch.zeros(2, 8))  # refused before any write
