"""outcore::stochastic_round_ — fp32 -> bf16 stochastic rounding with counter-based bits."""
import textwrap

import pytest
import torch

from outcore._optional import is_triton_available
from outcore.errors import ConfigError
from outcore.kernels.cpu_ext import supported_isa_levels
from outcore.kernels.stochastic_round import random_bits, round_key, stochastic_round_, stochastic_round_ref_
from tests._helpers import needs_cpu_extension


def _sr(x: torch.Tensor, key: int, offset: int = 0) -> torch.Tensor:
    return stochastic_round_(torch.empty(x.shape, dtype=torch.bfloat16), x, key, offset)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values at or below and above ``x``'s magnitude (truncation, and one ulp more)."""
    bits = x.view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    return down, up


def _bias_in_sigmas(rounded_mean: torch.Tensor, x: torch.Tensor, draws: int) -> float:
    """How many standard errors the mean of ``draws`` roundings lies from ``x``, all elements
    pooled: each element's error is scaled by its ulp and by its own Bernoulli deviation."""
    down, up = _neighbours(x)
    ulp = (up - down).double()
    p = ((x.double() - down.double()) / ulp).clamp(0, 1)
    err = (rounded_mean.double() - x.double()) / ulp  # per element: mean(B) - p, B ~ Bernoulli(p)
    var = (p * (1 - p) / draws).sum()
    return float(err.sum() / var.sqrt())


def test_unbiased_on_many_draws_and_the_check_can_fail():
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-6, 3, 4096)  # many binades, both signs
    draws = 256  # x repeated: every copy's elements have indices of their own, so bits of their own
    mean = _sr(x.repeat(draws), round_key(0, 3, 0)).double().view(draws, -1).mean(0)
    assert abs(_bias_in_sigmas(mean, x, draws)) < 5
    # the same bound rejects a rounding biased by 1/64 ulp (a generator with 10 bits, not 16)
    y = (x.view(torch.int32) + (1 << 10)).view(torch.float32)
    biased = _sr(y.repeat(draws), round_key(0, 3, 0)).double().view(draws, -1).mean(0)
    assert abs(_bias_in_sigmas(biased, x, draws)) > 5


def test_one_value_rounds_up_with_the_right_frequency():
    x = torch.full((1 << 18,), 1.0 + 2.0 ** -10)  # 1/8 of the way from 1 to the next bf16 value
    up = (_sr(x, round_key(1, 0, 0)).float() > 1.0).double().mean().item()
    assert abs(up - 0.125) < 5 * (0.125 * 0.875 / (1 << 18)) ** 0.5


def test_result_is_a_neighbour_and_representable_values_stay():
    torch.manual_seed(0)
    x = torch.randn(10_000)
    y = _sr(x, 77).float()
    down, up = _neighbours(x)
    assert bool(((y == down) | (y == up)).all())
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(_sr(exact, 77).float(), exact)


def test_bits_are_a_function_of_key_and_index():
    torch.manual_seed(0)
    x = torch.randn(3 * 4096 + 17)
    key = round_key(5, 2, 9)
    whole = _sr(x, key)
    assert torch.equal(whole.view(torch.int16), _sr(x, key).view(torch.int16))
    pieces = [_sr(x[a:a + 4096], key, offset=a) for a in range(0, x.numel(), 4096)]
    assert torch.equal(torch.cat(pieces).view(torch.int16), whole.view(torch.int16))
    assert not torch.equal(_sr(x, round_key(5, 2, 10)).view(torch.int16), whole.view(torch.int16))
    assert not torch.equal(_sr(x, round_key(5, 3, 9)).view(torch.int16), whole.view(torch.int16))
    r = random_bits(key, 0, 1 << 16)
    assert int(r.min()) >= 0 and int(r.max()) < 1 << 16 and abs(r.double().mean().item() / 2**16 - 0.5) < 0.01


def test_special_values():
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e38])
    y = _sr(x, 12345).float()
    assert y[:2].isnan().all() and y[2] == float("inf") and y[3] == -float("inf")
    assert y[4] == 0 and y[5] == 0 and torch.signbit(y[5])
    assert 0 <= y[6] <= 1e-39 and y[7] < -2.9e38


def _hard_values() -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(3 * 4096 + 5) * torch.logspace(-30, 30, 3 * 4096 + 5)
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                             -1e-40, 3.3895e38, -3.3895e38, 1.0, -1.0])
    nans = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, -0x7FFFFF], dtype=torch.int32).view(torch.float32)
    return torch.cat([specials, nans, x])


def test_cpu_kernel_equals_the_reference_at_every_isa_level(monkeypatch):
    """The C++ loop (every ISA level this CPU runs: the compiler vectorizes it) gives the
    reference's bits: specials, NaN payloads, huge and tiny values, offsets across 2^32, keys
    with their high bits set."""
    needs_cpu_extension()
    x = _hard_values()
    for isa in supported_isa_levels():
        monkeypatch.setenv("OUTCORE_CPU_ISA", isa)
        for key, offset in ((round_key(3, 7, 11), 12345), (2**63 - 1, 2**32 - 100), (0, 0)):
            ref = torch.empty(x.shape, dtype=torch.bfloat16)
            stochastic_round_ref_(ref, x, key, offset)
            assert torch.equal(_sr(x, key, offset).view(torch.int16), ref.view(torch.int16)), (isa, key, offset)


@pytest.mark.parametrize("bad,match", [
    (lambda: _sr(torch.zeros(4, dtype=torch.float64), 0), "torch.float64 into torch.bfloat16"),
    (lambda: stochastic_round_(torch.empty(5, dtype=torch.bfloat16), torch.zeros(4), 0), r"shape \(5,\)"),
    (lambda: stochastic_round_(torch.empty(4, 4, dtype=torch.bfloat16).t(), torch.zeros(4, 4), 0), "contiguous"),
    (lambda: _sr(torch.zeros(4), -1), "key=-1"),
    (lambda: _sr(torch.zeros(4), 0, offset=-3), "offset=-3"),
    (lambda: round_key(0, -1, 0), "index=-1"),
])
def test_bad_inputs_name_the_value(bad, match):
    with pytest.raises(ConfigError, match=match):
        bad()


# Run in the Triton interpreter by the `run_in_triton_interpreter` fixture (tests/kernels/conftest.py).
_TRITON_CHECK = textwrap.dedent("""
    import torch
    from outcore.kernels.stochastic_round import round_key, stochastic_round_
    from outcore.kernels.stochastic_round_triton import stochastic_round_triton_
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.randn(3 * 4096 + 5) * torch.logspace(-30, 30, 3 * 4096 + 5)
    x[:4] = torch.tensor([float("nan"), float("inf"), -1e-40, -float("nan")])
    x = x.to(dev)
    for key, offset in ((round_key(3, 7, 11), 12345), (2**63 - 1, 2**32 - 100)):
        ref = torch.empty(x.shape, dtype=torch.bfloat16)
        stochastic_round_(ref, x.cpu(), key, offset)  # on the CPU: the reference
        got = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)
        stochastic_round_triton_(got, x, key, offset)
        assert torch.equal(got.cpu().view(torch.int16), ref.view(torch.int16)), (key, offset)
    print("ok")
""")


@pytest.mark.skipif(not is_triton_available(), reason="triton is not installed")
def test_triton_equals_the_reference_in_the_interpreter(run_in_triton_interpreter):
    out = run_in_triton_interpreter(_TRITON_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.gpu
def test_cuda_dispatch_equals_the_cpu_reference():
    torch.manual_seed(0)
    x = torch.randn(100_000)
    key = round_key(1, 2, 3)
    got = stochastic_round_(torch.empty(x.shape, dtype=torch.bfloat16, device="cuda"), x.cuda(), key, 8)
    assert torch.equal(got.cpu().view(torch.int16), _sr(x, key, 8).view(torch.int16))
