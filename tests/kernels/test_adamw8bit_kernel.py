"""The fused 8-bit AdamW update: every implementation bit-identical to the reference.

The C++ extension is compiled on first use (about 45 s on a 2-core machine, then cached in
TORCH_EXTENSIONS_DIR); tests that need it skip when it cannot be built. Its AVX-512 path
quantizes with verified segment tables (``segment_tables``) and falls back to the exact
bucket method next to code boundaries: the adversarial tests below aim at those boundaries.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from outcore.kernels.adamw8bit import (adamw8bit_update, coefficients, cpu_extension, cpu_isa,
                                       init_codes, quantize_blockwise_cpp)
from outcore.kernels.adamw8bit_segments import _segment_code_f, _segment_code_near, segment_tables
from outcore.kernels.quantize import (dequantize_blockwise, dynamic_map, num_blocks,
                                      quantize_blockwise, thresholds)

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), init_codes(n, True), torch.zeros(num_blocks(n)),
            init_codes(n, False), torch.zeros(num_blocks(n))]


def _grad(n, step, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + step)) * scale


def _run(impl, n, steps, **hp):
    st = _state(n)
    for t in range(1, steps + 1):
        g = _grad(n, t, scale=10.0 ** (t % 5 - 3))  # magnitudes change: absmax moves
        if t == 3:
            g[: min(n, 300)] = 0  # an all-zero block
        adamw8bit_update(st[0], g, *st[1:], step=t, impl=impl, **{**HP, **hp})
    return st


def _needs_ext():
    if cpu_extension() is None:
        pytest.skip("the C++ extension cannot be built here")


@pytest.mark.parametrize("n", [256 * 64, 256 * 97 + 13, 4099])
def test_cpp_bit_identical_to_reference(n):
    _needs_ext()
    for hp in ({}, {"weight_decay": 0.0, "beta1": 0.0}):
        ref, cpp = _run("ref", n, 6, **hp), _run("cpp", n, 6, **hp)
        for a, b in zip(ref, cpp):
            assert torch.equal(a, b)


def _adversarial(signed: bool) -> torch.Tensor:
    """Values at, just above and just below every threshold and map entry, zeros, tiny and
    log-uniform random values; in blocks that each hold 1.0, so absmax = 1 and y = x."""
    q = dynamic_map(signed)
    t = thresholds(q)[:255]
    g = torch.Generator().manual_seed(1)
    rnd = torch.rand(20_000, generator=g) * 10.0 ** -torch.randint(0, 9, (20_000,), generator=g)
    vals = torch.cat([t, torch.nextafter(t, torch.tensor(2.0)), torch.nextafter(t, torch.tensor(-2.0)),
                      q, rnd, torch.tensor([0.0, 1e-38, 1e-45, 3e-10, 0.99999994])]).abs()
    if signed:
        vals = torch.cat([vals, -vals, torch.tensor([-0.0])])
    vals = vals[vals.abs() <= 1.0]
    vals = vals[torch.randperm(vals.numel(), generator=g)]
    blocks = torch.nn.functional.pad(vals, (0, (-vals.numel()) % 255)).view(-1, 255)
    return torch.cat([blocks, torch.ones(blocks.shape[0], 1)], dim=1).reshape(-1).contiguous()


@pytest.mark.parametrize("signed", [True, False])
def test_segment_tables_equal_searchsorted_where_unflagged(signed):
    """The numpy model of the fast quantizer (the tables as the C++ kernel reads them)."""
    y = _adversarial(signed).numpy()
    f, _ = _segment_code_f(np.abs(y), np.signbit(y).astype(np.int64), segment_tables(signed).numpy())
    code, flagged = _segment_code_near(f)
    want = np.searchsorted(thresholds(dynamic_map(signed)).numpy()[:255], y, side="left")
    assert (code[~flagged] == want[~flagged]).all()
    assert flagged.sum() >= 255  # every threshold itself is flagged: the fallback is exercised


@pytest.mark.parametrize("signed", [True, False])
def test_cpp_quantization_bit_identical_on_adversarial_values(signed):
    _needs_ext()
    x = _adversarial(signed)
    want = quantize_blockwise(x, dynamic_map(signed))
    got = quantize_blockwise_cpp(x, signed)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    scaled = x * 3.7e-4  # absmax != 1: the block normalization in between
    assert all(torch.equal(a, b) for a, b in zip(quantize_blockwise_cpp(scaled, signed),
                                                 quantize_blockwise(scaled, dynamic_map(signed))))


def test_cpp_quantization_rejects_negative_second_moments():
    _needs_ext()
    with pytest.raises(RuntimeError, match=r"x\[3\]=-1 is negative"):
        quantize_blockwise_cpp(torch.tensor([0.0, 1.0, 2.0, -1.0]), signed=False)


def test_cpu_isa_override(monkeypatch):
    monkeypatch.setenv("OUTCORE_CPU_ISA", "default")
    assert cpu_isa() == "DEFAULT"
    monkeypatch.setenv("OUTCORE_CPU_ISA", "SSE9")
    with pytest.raises(ValueError, match="OUTCORE_CPU_ISA='SSE9' is not one of"):
        cpu_isa()


@pytest.mark.slow  # builds two more variants of the extension (~45 s each on 2 cores)
@pytest.mark.parametrize("isa", ["DEFAULT", "AVX512"])
def test_lower_isa_builds_bit_identical(isa, monkeypatch):
    """The portable scalar build, and AVX-512 without VBMI (fp32-permute dequantizer)."""
    from outcore.kernels.adamw8bit import ISA_LEVELS
    if ISA_LEVELS.index(isa) > ISA_LEVELS.index(cpu_isa()):
        pytest.skip(f"this CPU is below {isa}")
    if cpu_extension(isa) is None:
        pytest.skip("the C++ extension cannot be built here")
    for signed in (True, False):
        x = _adversarial(signed)
        assert all(torch.equal(a, b) for a, b in zip(quantize_blockwise_cpp(x, signed, isa),
                                                     quantize_blockwise(x, dynamic_map(signed))))
    monkeypatch.setenv("OUTCORE_CPU_ISA", isa)
    n = 256 * 97 + 13
    for a, b in zip(_run("ref", n, 6), _run("cpp", n, 6)):
        assert torch.equal(a, b)


def test_update_many_equals_per_tensor_reference():
    """One C++ call over tensors of different sizes (partial blocks) and step counts."""
    _needs_ext()
    from outcore.kernels.adamw8bit import adamw8bit_update_many
    sizes, steps = [256 * 64, 4099, 256 * 97 + 13], [1, 3, 7]
    many = [_state(n, seed=i) for i, n in enumerate(sizes)]
    ref = [[t.clone() for t in st] for st in many]
    for rnd in range(3):
        grads = [_grad(n, rnd + 10 * i) for i, n in enumerate(sizes)]
        cs = [coefficients(HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], s + rnd)
              for s in steps]
        assert adamw8bit_update_many(*[[st[k] for st in many] for k in range(1)], grads,
                                     *[[st[k] for st in many] for k in range(1, 5)], cs)
        for st, g, s in zip(ref, grads, steps):
            adamw8bit_update(st[0], g, *st[1:], step=s + rnd, impl="ref", **HP)
    for a, b in zip(many, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_auto_is_the_op_and_matches_reference():
    ref, auto = _run("ref", 5000, 4), _run("auto", 5000, 4)
    for a, b in zip(ref, auto):
        assert torch.equal(a, b)


def test_reference_tracks_fp32_adamw():
    """Quantized moments change the trajectory only slightly (tolerance: quantization)."""
    n = 256 * 40
    st = _state(n)
    p = torch.nn.Parameter(st[0].clone())
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"])
    for t in range(1, 21):
        g = _grad(n, t)
        adamw8bit_update(st[0], g, *st[1:], step=t, impl="ref", **HP)
        p.grad = g
        opt.step()
    start = _state(n)[0]
    moved = (p.detach() - start).norm()
    assert float((st[0] - p.detach()).norm() / moved) < 0.05
    m = dequantize_blockwise(st[1], st[2], dynamic_map(True))
    exp_avg = opt.state[p]["exp_avg"]
    assert float((m - exp_avg).norm() / exp_avg.norm()) < 0.05


def test_coefficients_and_bad_inputs():
    c = coefficients(1e-3, 0.9, 0.999, 1e-8, 0.1, 1)
    assert c.step_size == pytest.approx(1e-2) and c.decay == pytest.approx(1 - 1e-4)
    with pytest.raises(ValueError, match="step=0"):
        coefficients(1e-3, 0.9, 0.999, 1e-8, 0.0, 0)
    st = _state(1000)
    with pytest.raises(ValueError, match="impl='fast'"):
        adamw8bit_update(st[0], _grad(1000, 1), *st[1:], step=1, impl="fast", **HP)
    with pytest.raises(ValueError, match="grad must be float32 with 1000 elements"):
        adamw8bit_update(st[0], torch.zeros(999), *st[1:], step=1, **HP)
    with pytest.raises(ValueError, match="m_absmax must be a contiguous torch.float32 tensor of 4"):
        adamw8bit_update(st[0], _grad(1000, 1), st[1], torch.zeros(3), *st[3:], step=1, **HP)
    with pytest.raises(ValueError, match="param must be a contiguous float32"):
        adamw8bit_update(st[0].half(), _grad(1000, 1), *st[1:], step=1, **HP)


def test_op_schema_and_fake_impl():
    st = _state(3000)
    torch.library.opcheck(torch.ops.outcore.adamw8bit_update.default,
                          (st[0], _grad(3000, 1), *st[1:], 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow  # ~40 s of Inductor compilation on 2 cores
def test_torch_compile_bit_identical_to_reference():
    ref, comp = _run("ref", 256 * 30 + 7, 3), _run("compile", 256 * 30 + 7, 3)
    for a, b in zip(ref, comp):
        assert torch.equal(a, b)


_TRITON_CHECK = r"""
import torch
from outcore.kernels.adamw8bit import adamw8bit_update_ref, coefficients, init_codes
from outcore.kernels.adamw8bit_triton import adamw8bit_update_triton
from outcore.kernels.quantize import num_blocks
n = 256 * 80 + 5
g = torch.Generator().manual_seed(0)
a = [torch.randn(n, generator=g), init_codes(n, True), torch.zeros(num_blocks(n)),
     init_codes(n, False), torch.zeros(num_blocks(n))]
b = [t.clone() for t in a]
for s in range(1, 5):
    grad = torch.randn(n, generator=g) * 10.0 ** (s - 3)
    c = coefficients(1e-2, 0.9, 0.999, 1e-8, 0.1, s)
    adamw8bit_update_ref(a[0], grad, *a[1:], c)
    adamw8bit_update_triton(b[0], grad, *b[1:], c)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), s
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_bit_identical_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # must be set before triton is imported
    out = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_update_bit_identical_to_cpu_reference():
    n = 256 * 1000 + 3
    cpu = _state(n)
    gpu = [t.cuda() for t in cpu]
    for t in range(1, 5):
        g = _grad(n, t)
        adamw8bit_update(cpu[0], g, *cpu[1:], step=t, impl="ref", **HP)
        adamw8bit_update(gpu[0], g.cuda(), *gpu[1:], step=t, **HP)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
