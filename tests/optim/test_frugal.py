"""FRUGAL against its definition: AdamW on a seeded column subset, signSGD elsewhere."""
from __future__ import annotations

import math

import torch

from outcore.optim import FRUGAL
from outcore.optim._lowrank import next_seed
from outcore.optim.frugal import subspace_columns


def _dense_reference(p0, grads, lr, wd, density, gap, free, seed, betas=(0.9, 0.999), eps=1e-8):
    """FRUGAL written out with dense masks (no in-place tricks)."""
    p = p0.clone()
    n = p.shape[1]
    k = math.ceil(density * n)
    m = torch.zeros(p.shape[0], k)
    v = torch.zeros(p.shape[0], k)
    t_sub = 0
    for t, g in enumerate(grads):
        if t > 0 and t % gap == 0:
            seed = next_seed(seed)
            m.zero_()
            v.zero_()
            t_sub = 0
        cols = subspace_columns(n, k, seed, p.device)
        t_sub += 1
        p = p * (1 - lr * wd)
        gs = g[:, cols]
        m = m + (gs - m) * (1 - betas[0])
        v = v * betas[1] + gs * gs * (1 - betas[1])
        adam = (m / (1 - betas[0] ** t_sub)) / (v.sqrt() / math.sqrt(1 - betas[1] ** t_sub) + eps)
        new = p - free * lr * g.sign()
        new[:, cols] = p[:, cols] - lr * adam
        p = new
    return p


def test_matches_dense_definition():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(16, 40, generator=g)
    grads = [torch.randn(16, 40, generator=g) for _ in range(7)]
    p = torch.nn.Parameter(p0.clone())
    opt = FRUGAL([p], lr=1e-2, weight_decay=0.1, density=0.25, update_proj_gap=3,
                 free_lr_scale=0.5, seed=5)
    for gr in grads:
        p.grad = gr
        opt.step()
    want = _dense_reference(p0, grads, 1e-2, 0.1, 0.25, 3, 0.5, seed=5)
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    assert opt.state[p]["exp_avg"].shape == (16, 10)
    assert int(opt.state[p]["sub_step"]) == 1  # reset at step 6, one step since


def test_vectors_get_full_adamw():
    p = torch.nn.Parameter(torch.randn(50))
    q = torch.nn.Parameter(p.detach().clone())
    a = FRUGAL([p], lr=1e-2, weight_decay=0.1)
    b = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for t in range(3):
        p.grad = torch.randn(50, generator=torch.Generator().manual_seed(t))
        q.grad = p.grad.clone()
        a.step()
        b.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_bf16_parameters_step():
    """bf16 weights take the reference (the C++ step is fp32's): a step that moves them."""
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(16, 40, generator=g).bfloat16())
    v = torch.nn.Parameter(torch.randn(40, generator=g).bfloat16())
    before = [p.detach().clone(), v.detach().clone()]
    opt = FRUGAL([p, v], lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        p.grad, v.grad = torch.randn(p.shape, generator=g).bfloat16(), torch.randn(v.shape, generator=g).bfloat16()
        opt.step()
    for now, then in zip((p, v), before):
        assert now.dtype == torch.bfloat16 and torch.isfinite(now).all() and not torch.equal(now, then)
