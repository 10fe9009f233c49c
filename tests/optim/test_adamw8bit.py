"""AdamW8bit as an optimizer: state layout and bytes, small-tensor path, training quality."""
from __future__ import annotations

import pytest
import torch

from outcore.kernels.adamw8bit import STATE_FORMATS
from outcore.optim import AdamW, AdamW8bit


def _state_bytes(opt):
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())


def test_state_is_about_two_bytes_per_parameter():
    p = torch.nn.Parameter(torch.randn(512, 256))
    p.grad = torch.randn(512, 256)
    opt = AdamW8bit([p])
    opt.step()
    st = opt.state[p]
    assert st["m_codes"].dtype == st["v_codes"].dtype == torch.uint8
    per_param = _state_bytes(opt) / p.numel()
    assert 2.0 < per_param < 2.05  # 2 code bytes + 8 bytes of absmax per 256 + the step


def _step_both(a, ps, b, qs, steps):
    """Step optimizers ``a`` (over ``ps``) and ``b`` (over ``qs``) with the same seeded gradients."""
    for t in range(steps):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t))
            q.grad = p.grad.clone()
        a.step()
        b.step()


def test_small_tensors_are_fp32_and_bit_identical_to_adamw():
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(64,), (10, 40)]]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a, b = AdamW8bit(ps, lr=1e-2, weight_decay=0.1), AdamW(qs, lr=1e-2, weight_decay=0.1)
    _step_both(a, ps, b, qs, steps=4)
    for p, q in zip(ps, qs):
        assert "exp_avg" in a.state[p] and torch.equal(p, q)


def test_rejects_half_precision_parameters():
    p = torch.nn.Parameter(torch.randn(128, 64).half())
    p.grad = torch.randn(128, 64).half()
    with pytest.raises(ValueError, match="float32 parameters.*torch.float16"):
        AdamW8bit([p]).step()


def test_impls_agree_through_the_optimizer():
    """"auto" and "cpp" (the C++ kernel where it builds) agree bit for bit and stay within the
    kernel's contract of the pure-PyTorch reference (kernels/adamw8bit.py)."""
    from outcore.kernels.cpu_ext import cpu_extension
    ps = [torch.nn.Parameter(torch.randn(300, 50, generator=torch.Generator().manual_seed(i)))
          for i in range(3)]
    runs = {}
    for impl in ("ref", "auto", "cpp") if cpu_extension() is not None else ("ref", "auto"):
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = AdamW8bit(qs, impl=impl)
        for t in range(3):
            for q in qs:
                q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(t))
            opt.step()
        runs[impl] = qs
    if "cpp" in runs:
        assert all(torch.equal(a, b) for a, b in zip(runs["auto"], runs["cpp"]))
    for a, b in zip(runs["auto"], runs["ref"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_trains_a_tiny_llama_like_adamw(tiny_llama_factory, fmt):
    a, b = tiny_llama_factory(layers=2), tiny_llama_factory(layers=2)
    opts = [AdamW8bit(a.parameters(), lr=3e-3, state_format=fmt), AdamW(b.parameters(), lr=3e-3)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 32), generator=g)
    losses = []
    for model, opt in zip((a, b), opts):
        for _ in range(10):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
        losses.append(float(loss))
    first = float(tiny_llama_factory(layers=2)(input_ids=ids, labels=ids).loss)
    assert losses[0] < first - 1.0  # it learns
    assert abs(losses[0] - losses[1]) / losses[1] < 0.05  # like fp32 AdamW


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_state_format_steps_like_its_reference_and_round_trips(fmt):
    """Either state format: the C++ path equal to the reference's bits, and state_dict() carries
    the format: an optimizer built with the other format, loading it, continues the
    uninterrupted run bit for bit."""
    import copy

    from outcore.kernels.cpu_ext import cpu_extension

    def params():
        return [torch.nn.Parameter(torch.randn(300, 50, generator=torch.Generator().manual_seed(i)))
                for i in range(2)]

    def run(opt, ps, steps, start=0):
        for t in range(start, start + steps):
            for q in ps:
                q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(t))
            opt.step()

    other = next(f for f in STATE_FORMATS if f != fmt)
    fresh = AdamW8bit(params(), state_format=fmt)
    fresh.step()  # no gradients: nothing happens
    ps = params()
    opt = AdamW8bit(ps, state_format=fmt, impl="ref")
    st = opt.state_dict()
    assert st["param_groups"][0]["state_format"] == fmt
    run(opt, ps, 3)
    if cpu_extension() is not None:
        qs = params()
        cpp = AdamW8bit(qs, state_format=fmt, impl="cpp")
        run(cpp, qs, 3)
        assert all(torch.equal(a, b) for a, b in zip(ps, qs))
    sd = copy.deepcopy(opt.state_dict())
    resumed_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = AdamW8bit(resumed_ps, impl="ref", state_format=other)  # the format comes from the state
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["state_format"] == fmt
    run(opt, ps, 2, start=3)
    run(resumed, resumed_ps, 2, start=3)
    assert all(torch.equal(a, b) for a, b in zip(ps, resumed_ps))


def test_a_state_saved_without_a_format_loads_as_dynamic():
    """Checkpoints from before state_format hold dynamic-map codes."""
    ps = [torch.nn.Parameter(torch.randn(100, 50))]
    opt = AdamW8bit(ps, state_format="dynamic")
    ps[0].grad = torch.randn(100, 50)
    opt.step()
    sd = opt.state_dict()
    del sd["param_groups"][0]["state_format"]
    other = AdamW8bit([torch.nn.Parameter(ps[0].detach().clone())], state_format="fp8")
    other.load_state_dict(sd)
    assert other.param_groups[0]["state_format"] == "dynamic"
