"""AdamW8bit as an optimizer: state layout and bytes, small-tensor path, training quality."""
from __future__ import annotations

import pytest
import torch

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
    from outcore.kernels.adamw8bit import cpu_extension
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


def test_trains_a_tiny_llama_like_adamw(tiny_llama_factory):
    a, b = tiny_llama_factory(layers=2), tiny_llama_factory(layers=2)
    opts = [AdamW8bit(a.parameters(), lr=3e-3), AdamW(b.parameters(), lr=3e-3)]
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
