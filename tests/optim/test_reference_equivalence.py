"""Ours == the reference implementations, on a tiny Llama, same seed and hyper-parameters.

* AdamW == torch.optim.AdamW(fused=True), bit for bit (weight decay included).
* GaLore == galore_torch.GaLoreAdamW, APOLLO / APOLLO-Mini == apollo_torch.APOLLOAdamW:
  parameters after 10 steps within 1e-5 relative (skipped without the reference package).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from outcore.optim import APOLLO, AdamW, APOLLOMini, GaLore

needs_galore = pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None,
                                  reason="galore-torch not installed (extra: test)")
needs_apollo = pytest.mark.skipif(importlib.util.find_spec("apollo_torch") is None,
                                  reason="apollo-torch not installed (extra: test)")


def _train(model, opt, steps=10, seed=0):
    """In memory on the model's device (the batches drawn on the CPU, moved there)."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def _groups(model, **lowrank):
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    ids = {id(p) for p in mats}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": rest}, {"params": mats, **lowrank}]


def _assert_close(a, b, rtol=1e-5):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        err = (p.detach() - q.detach()).norm() / q.detach().norm().clamp_min(1e-12)
        assert err <= rtol, f"{n}: relative difference {err:.3g}"


def test_adamw_bit_identical_to_torch_fused(tiny_llama_factory, compute_device):
    a, b = tiny_llama_factory(layers=2).to(compute_device), tiny_llama_factory(layers=2).to(compute_device)
    kw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    _train(a, AdamW(a.parameters(), **kw), steps=6)
    _train(b, torch.optim.AdamW(b.parameters(), fused=True, **kw), steps=6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@needs_galore
def test_galore_matches_reference(tiny_llama_factory, compute_device):
    from galore_torch import GaLoreAdamW

    a, b = tiny_llama_factory(layers=2).to(compute_device), tiny_llama_factory(layers=2).to(compute_device)
    kw = dict(lr=1e-3, weight_decay=0.01)
    low = dict(rank=8, update_proj_gap=4, scale=0.25)
    _train(a, GaLore(_groups(a, **low), rank=None, **kw))
    _train(b, GaLoreAdamW(_groups(b, **low, proj_type="std"), **kw))
    _assert_close(a, b)


@needs_apollo
@pytest.mark.parametrize("mini", [False, True])
def test_apollo_matches_reference(tiny_llama_factory, mini, compute_device):
    from apollo_torch import APOLLOAdamW

    a, b = tiny_llama_factory(layers=2).to(compute_device), tiny_llama_factory(layers=2).to(compute_device)
    kw = dict(lr=1e-3, weight_decay=0.01)
    low = (dict(rank=1, update_proj_gap=4, scale=128.0, scale_type="tensor") if mini
           else dict(rank=8, update_proj_gap=4, scale=1.0, scale_type="channel"))
    cls = APOLLOMini if mini else APOLLO
    _train(a, cls(_groups(a, **low), rank=None, **kw))
    _train(b, APOLLOAdamW(_groups(b, **low, proj="random", proj_type="std"), **kw))
    _assert_close(a, b)


@needs_apollo
def test_apollo_state_is_seed_not_matrix(tiny_llama_factory):
    m = tiny_llama_factory(layers=1)
    opt = APOLLOMini(_groups(m, rank=1), rank=None)
    _train(m, opt, steps=2)
    p = next(p for p in m.parameters() if p.dim() == 2 and p.shape[0] != 256)
    st = opt.state[p]
    assert st["seed"].dtype == torch.int64 and st["seed"].dim() == 0
    assert sum(v.numel() for v in st.values()) == 2 * max(p.shape) + 3
