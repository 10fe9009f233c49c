"""The OutcoreOptimizer contract, checked for every optimizer of outcore.optim.

* state_spec() matches init_state() and what step() creates,
* update() on state held elsewhere (an "arena") == step() on self.state, bit for bit,
* state_dict() -> load into a fresh optimizer -> continue == uninterrupted, bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch

from outcore.errors import ConfigError
from outcore.optim import (APOLLO, FRUGAL, OPTIMIZERS, AdamW, AdamW8bit, APOLLOMini, GaLore,
                           OutcoreOptimizer, build_optimizer)

KW = {
    "adamw": dict(lr=1e-2, weight_decay=0.1),
    "adamw8bit": dict(lr=1e-2, weight_decay=0.1),
    "galore": dict(lr=1e-2, rank=4, update_proj_gap=2, scale=0.5, weight_decay=0.1),
    "apollo": dict(lr=1e-2, rank=4, update_proj_gap=2, weight_decay=0.1),
    "apollo-mini": dict(lr=1e-2, update_proj_gap=2),
    "frugal": dict(lr=1e-2, density=0.25, update_proj_gap=2, weight_decay=0.1),
}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(96, 64), (48, 160), (64,), (5000,), (3, 7)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt, params, steps, start=0):
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_spec_matches_state(name):
    params = _params()
    opt = build_optimizer(name, params, **KW[name])
    assert isinstance(opt, OutcoreOptimizer)
    _run(opt, params, 1)
    for p in params:
        spec = opt.state_spec(p, opt.param_groups[0])
        fresh = opt.init_state(p, opt.param_groups[0])
        live = opt.state[p]
        assert list(spec) == list(fresh) == list(live)
        for k, (shape, dtype) in spec.items():
            assert fresh[k].shape == live[k].shape == shape, (name, k)
            assert fresh[k].dtype == live[k].dtype == dtype, (name, k)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_on_external_state_equals_step(name):
    params = _params()
    arena_params = [p.detach().clone() for p in params]
    opt = build_optimizer(name, params, **KW[name])
    driver = build_optimizer(name, _params(), **KW[name])  # only its spec/init/update are used
    group = driver.param_groups[0]
    arena_states = [driver.init_state(p, group) for p in driver.param_groups[0]["params"]]
    for t in range(5):
        grads = _grads(params, t)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        driver.update(arena_params, grads, arena_states, group)
    assert not driver.state  # update() never touches self.state
    for p, q in zip(params, arena_params):
        assert torch.equal(p.detach(), q), name
    for p, st in zip(params, arena_states):
        for k, v in opt.state[p].items():
            assert torch.equal(v, st[k]), (name, k)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_round_trip_is_bit_identical(name):
    ref_params = _params()
    ref = build_optimizer(name, ref_params, **KW[name])
    _run(ref, ref_params, 7)

    params = _params()
    opt = build_optimizer(name, params, **KW[name])
    _run(opt, params, 3)
    sd = copy.deepcopy(opt.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = build_optimizer(name, resumed_params, **KW[name])
    resumed.load_state_dict(sd)
    for p, q in zip(params, resumed_params):
        for k, v in opt.state[p].items():
            assert resumed.state[q][k].dtype == v.dtype and torch.equal(resumed.state[q][k], v)
    _run(resumed, resumed_params, 4, start=3)
    for p, q in zip(ref_params, resumed_params):
        assert torch.equal(p.detach(), q.detach()), name


def test_lazy_mezo_exports_do_not_import_eagerly():
    import sys

    import outcore.optim as optim
    assert "outcore.optim.mezo" not in sys.modules or hasattr(optim, "MeZO")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        optim.Nope  # noqa: B018


def test_build_optimizer_errors_name_the_value():
    p = _params()
    with pytest.raises(ConfigError, match="optim='lion'"):
        build_optimizer("lion", p)
    with pytest.raises(ConfigError, match=r"\['bogus'\]"):
        build_optimizer("galore", p, bogus=1)
    with pytest.raises(ConfigError, match="rank=0"):
        build_optimizer("apollo", p, rank=0)
    assert isinstance(build_optimizer("adamw8bit", p, betas=[0.8, 0.9]), AdamW8bit)


@pytest.mark.parametrize("cls,kw,match", [
    (AdamW, dict(lr=-1.0), "lr=-1.0"),
    (AdamW8bit, dict(betas=(0.9, 1.0)), r"betas=\(0.9, 1.0\)"),
    (AdamW8bit, dict(impl="fast"), "impl='fast'"),
    (AdamW8bit, dict(state_format="int8"), "state_format='int8'"),
    (GaLore, dict(update_proj_gap=0), "update_proj_gap=0"),
    (APOLLO, dict(scale_type="row"), "scale_type='row'"),
    (APOLLOMini, dict(scale=0.0), "scale=0.0"),
    (FRUGAL, dict(density=1.5), "density=1.5"),
    (FRUGAL, dict(eps=-1.0), "eps=-1.0"),
])
def test_bad_hyper_parameters(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(_params(), **kw)


def test_sparse_grad_rejected():
    p = torch.nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamW([p]).step()
