"""The Triton chunk kernel == the PyTorch reference, under TRITON_INTERPRET=1 on CPU.

Triton decides interpreter vs compiler when ``@triton.jit`` runs (at import of
the kernel module), so the CPU check runs in a fresh subprocess with the
variable set; other test modules in this process are not affected.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from outcore._optional import is_triton_available

needs_triton = pytest.mark.skipif(not is_triton_available(), reason="triton is not installed")

_CHECK = textwrap.dedent("""
    import torch
    from outcore.kernels import linear_cross_entropy as lce
    from outcore.kernels.linear_cross_entropy_triton import ce_chunk_triton
    from outcore.kernels._library import triton_usable
    assert triton_usable(torch.zeros(1))
    g = torch.Generator().manual_seed(0)
    n, h, v = 40, 8, 700  # V not a power of two: masked tail of the tile
    hid, w, b = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g); t[::6] = -100
    for eps, scale in ((0.0, torch.tensor(0.25)), (0.1, torch.rand(n, generator=g))):
        for need in (True, False):
            ours = lce.lce_chunks(hid, w, t, b, scale, -100, eps, 16, need, need, need, ce_chunk_triton)
            ref = lce.lce_chunks(hid, w, t, b, scale, -100, eps, 16, need, need, need,
                                 lce.ce_chunk_reference)
            for a, r in zip(ours, ref):
                if r is None:
                    assert a is None
                    continue
                err = ((a.double() - r.double()).norm() / r.double().norm()).item()
                assert err <= 1e-6, (eps, need, err)
    print("ok")
""")


@needs_triton
def test_triton_chunk_kernel_matches_reference_in_interpreter(run_in_triton_interpreter):
    out = run_in_triton_interpreter(_CHECK)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.gpu
@needs_triton
def test_cuda_op_uses_triton_and_matches_reference():
    from outcore.kernels.linear_cross_entropy import linear_cross_entropy
    torch.manual_seed(0)
    h = torch.randn(1000, 64, device="cuda", requires_grad=True)
    w = torch.randn(5000, 64, device="cuda", requires_grad=True)
    t = torch.randint(0, 5000, (1000,), device="cuda")
    t[::9] = -100
    for eps in (0.0, 0.1):
        ours = linear_cross_entropy(h, w, t, label_smoothing=eps, chunk_size=256)
        go = torch.autograd.grad(ours, [h, w])
        ref = torch.nn.functional.cross_entropy(h @ w.T, t, label_smoothing=eps)
        gr = torch.autograd.grad(ref, [h, w])
        assert torch.allclose(ours, ref, rtol=1e-5)
        for a, r in zip(go, gr):
            assert ((a - r).norm() / r.norm()).item() <= 1e-5
