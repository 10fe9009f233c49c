"""The fused 8-bit AdamW update against the pure-PyTorch reference.

Contract (kernels/adamw8bit.py): the C++ extension at every ISA level (scalar, AVX2,
AVX-512 with and without VBMI), torch.compile and Triton are bit-identical to the reference
for finite inputs, and deterministic (any thread count, per tensor or batched: same bits),
in both state formats (the dynamic maps, FP8) where the path implements them.
The vector quantizer's tables (kernels/adamw8bit_segments.py) are proven exhaustively when
built; the tests check the proof is not vacuous and the kernel follows its model.

The C++ extension is compiled on first use (about 20-45 s per ISA level on a 2-core
machine, then cached in TORCH_EXTENSIONS_DIR); tests that need it skip when it cannot be
built.
"""
from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from outcore.kernels.adamw8bit import (STATE_FORMATS, adamw8bit_update, adamw8bit_update_many,
                                       coefficients, fp8_quantize_blockwise_cpp, init_codes,
                                       quantize_blockwise_cpp)
from outcore.kernels.cpu_ext import cpu_extension, cpu_isa, supported_isa_levels
from outcore.kernels.adamw8bit_segments import SEG_NEAR, _build, _pieces, _verify, segment_code
from outcore.kernels.quantize import (blocks_view, dequantize_blockwise, dynamic_map, num_blocks,
                                      quantize_blockwise, thresholds)
from outcore.kernels.quantize_fp8 import FP8_DTYPES, fp8_dequantize_blocks, fp8_quantize_blocks
from outcore.kernels.stochastic_round import stochastic_round_ref_
from tests._helpers import needs_cpu_extension

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _state(n, seed=0, fmt="dynamic"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), init_codes(n, True, state_format=fmt), torch.zeros(num_blocks(n)),
            init_codes(n, False, state_format=fmt), torch.zeros(num_blocks(n))]


def _grad(n, step, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + step)) * scale


def _run(impl, n, steps, fmt="dynamic", **hp):
    st = _state(n, fmt=fmt)
    for t in range(1, steps + 1):
        g = _grad(n, t, scale=10.0 ** (t % 5 - 3))  # magnitudes change: absmax moves
        if t == 3:
            g[: min(n, 300)] = 0  # an all-zero block
        if t == 4:
            g[: min(n, 100)] = -0.0  # negative zeros: FP8 codes keep the sign of zero
        adamw8bit_update(st[0], g, *st[1:], step=t, impl=impl, state_format=fmt, **{**HP, **hp})
    return st


LEAN_SIZES, LEAN_KEY, LEAN_OFFSET = [256 * 64, 4099, 256 * 97 + 13], (0x5DEECE66D << 23) + 11, 3 * 4096


def _run_lean(fused, steps=4, fmt="dynamic"):
    """bf16-lean steps of tensors of LEAN_SIZES: one fused C++ call per step, or each tensor
    widened, updated by the reference and rounded back by the rounding's reference."""
    sts = [_state(n, seed=i, fmt=fmt) for i, n in enumerate(LEAN_SIZES)]
    for st in sts:
        st[0] = st[0].to(torch.bfloat16)
    for t in range(1, steps + 1):
        grads = [_grad(n, t + 10 * i, scale=10.0 ** (t % 5 - 3)).to(torch.bfloat16) for i, n in enumerate(LEAN_SIZES)]
        rounding = [(LEAN_KEY + 7 * t + i, LEAN_OFFSET * i) for i in range(len(sts))]
        if fused:
            c = coefficients(HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], t)
            assert adamw8bit_update_many([st[0] for st in sts], grads, *[[st[k] for st in sts] for k in range(1, 5)],
                                         [c] * len(sts), rounding, fmt)
            continue
        for st, g, (key, offset) in zip(sts, grads, rounding):
            w = st[0].float()
            adamw8bit_update(w, g.float(), *st[1:], step=t, impl="ref", state_format=fmt, **HP)
            stochastic_round_ref_(st[0], w, key, offset)
    return sts


@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("n", [256 * 64, 256 * 97 + 13, 4099])
def test_cpp_step_bit_identical_to_reference(n, fmt):
    """Along the reference's trajectory, each C++ step equals the reference's step from the
    same state, bit for bit (gradient scales jumping by 10^4, an all-zero block, negative
    zeros, beta1 = 0)."""
    needs_cpu_extension()
    for hp in ({}, {"weight_decay": 0.0, "beta1": 0.0}):
        st = _state(n, fmt=fmt)
        for t in range(1, 7):
            g = _grad(n, t, scale=10.0 ** (t % 5 - 3))
            if t == 3:
                g[: min(n, 300)] = 0  # an all-zero block
            if t == 4:
                g[: min(n, 100)] = -0.0
            cpp = [x.clone() for x in st]
            adamw8bit_update(cpp[0], g, *cpp[1:], step=t, impl="cpp", state_format=fmt, **{**HP, **hp})
            adamw8bit_update(st[0], g, *st[1:], step=t, impl="ref", state_format=fmt, **{**HP, **hp})
            assert all(torch.equal(a, b) for a, b in zip(cpp, st)), t


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_cpp_zero_learning_rate_leaves_params_exactly(fmt):
    """lr = 0 moves no parameter, even where v = 0, and updates the moments like the
    reference."""
    needs_cpu_extension()
    n = 256 * 40
    st = _state(n, fmt=fmt)
    ref = [x.clone() for x in st]
    g = _grad(n, 1)
    g[:256] = 0  # a block with v = 0 and m = 0
    adamw8bit_update(st[0], g, *st[1:], step=1, impl="cpp", state_format=fmt, **{**HP, "lr": 0.0})
    adamw8bit_update(ref[0], g, *ref[1:], step=1, impl="ref", state_format=fmt, **{**HP, "lr": 0.0})
    assert torch.equal(st[0], _state(n)[0])
    assert all(torch.equal(a, b) for a, b in zip(st, ref))


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_cpp_trajectory_bit_identical_to_reference(fmt):
    """Twenty steps each, with gradient scales jumping by 10^4: the same bits throughout."""
    needs_cpu_extension()
    n = 256 * 200 + 7
    for a, b in zip(_run("ref", n, 20, fmt), _run("cpp", n, 20, fmt)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_cpp_deterministic_across_threads_and_batching(fmt):
    """Same bits with 1 or 2 threads, per tensor or in one batched call (the out-of-core
    engine and the in-memory optimizer rely on it)."""
    needs_cpu_extension()
    sizes = [256 * 300, 4099, 256 * 64]
    runs = []
    for threads, batched in ((1, False), (2, False), (2, True)):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            states = [_state(n, seed=i, fmt=fmt) for i, n in enumerate(sizes)]
            for t in range(1, 4):
                grads = [_grad(n, t + 10 * i) for i, n in enumerate(sizes)]
                if batched:
                    c = coefficients(HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], t)
                    assert adamw8bit_update_many(*[[st[0] for st in states]], grads,
                                                 *[[st[k] for st in states] for k in range(1, 5)],
                                                 [c] * len(sizes), state_format=fmt)
                else:
                    for st, g in zip(states, grads):
                        adamw8bit_update(st[0], g, *st[1:], step=t, impl="cpp", state_format=fmt, **HP)
            runs.append(states)
        finally:
            torch.set_num_threads(old)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


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


def _ordinary(signed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(256 * 400, generator=g) ** (1 if signed else 2)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("f_of_key", [True, False])  # the AVX2 and the AVX-512 arithmetic
def test_segment_model_equals_searchsorted_outside_its_guard(signed, f_of_key):
    """The numpy model of the vector quantizer (the tables as the kernels read them): every
    value it does not hand to the exact method gets searchsorted's code; it hands over few."""
    tab = _build(signed)
    t = thresholds(dynamic_map(signed)).numpy()[:255]
    ordinary = _ordinary(signed) / _ordinary(signed).abs().max()  # normalized, as y is
    for y, max_guarded in ((_adversarial(signed).numpy(), 0.05), (ordinary.numpy(), 1e-3)):
        code, guarded = segment_code(y, tab, f_of_key)
        want = np.searchsorted(t, y, side="left")
        assert (code[~guarded] == want[~guarded]).all()
        assert guarded.mean() <= max_guarded


@pytest.mark.parametrize("signed", [True, False])
def test_segment_proof_is_not_vacuous(signed):
    """The exhaustive check rejects tables a little off: an offset moved by a tenth of a code,
    or a guard band too narrow."""
    bounds, _ = _pieces(signed)
    tab = _build(signed).copy()
    tab[2, 6] += np.float32(0.1)  # column 6: a decade's line (both maps)
    with pytest.raises(AssertionError, match="misses its codes"):
        _verify(tab, bounds, signed)
    import outcore.kernels.adamw8bit_segments as seg
    old = seg.SEG_NEAR
    try:
        seg.SEG_NEAR = 0
        with pytest.raises(AssertionError):
            _verify(_build(signed), bounds, signed)
    finally:
        seg.SEG_NEAR = old
    assert SEG_NEAR == old


def _assert_quantizes_like_reference(signed: bool, isa: str | None = None) -> None:
    for x in (_adversarial(signed), _ordinary(signed)):
        got = quantize_blockwise_cpp(x, signed, isa)
        want = quantize_blockwise(x, dynamic_map(signed))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("signed", [True, False])
def test_cpp_quantization_bit_identical(signed):
    """Adversarial values (at, just above and just below every threshold and map entry, zeros,
    tiny) and ordinary ones: the reference's codes and absmax."""
    needs_cpu_extension()
    _assert_quantizes_like_reference(signed)


def _fp8_adversarial(signed: bool) -> torch.Tensor:
    """Every FP8 value of the format, the midpoints between neighbours (ties: to even) and
    the floats just above and below them, zeros, tiny values and random ones, in blocks that
    each hold the format's largest value (absmax / max = 1: y = x); then a block of 255 zeros
    with one tiny value (a huge multiplier), an all-zero block and a partial block."""
    dtype = FP8_DTYPES[signed]
    top = float(torch.finfo(dtype).max)
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique().double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    g = torch.Generator().manual_seed(5)
    rnd = torch.rand(20_000, generator=g) * top * 2.0 ** -torch.randint(0, 30, (20_000,), generator=g).float()
    vals = torch.cat([grid.float(), mids, torch.nextafter(mids, torch.tensor(1e9)),
                      torch.nextafter(mids, torch.tensor(-1.0)), rnd, torch.tensor([0.0, 1e-38, 1e-45])])
    if signed:
        vals = torch.cat([vals, -vals, torch.tensor([-0.0])])
    vals = vals[vals.abs() <= top]
    vals = vals[torch.randperm(vals.numel(), generator=g)]
    blocks = torch.nn.functional.pad(vals, (0, (-vals.numel()) % 255)).view(-1, 255)
    full = torch.cat([blocks, torch.full((blocks.shape[0], 1), top)], dim=1).reshape(-1)
    tiny = torch.zeros(256)
    tiny[7] = 1e-40 if signed else 3e-39
    return torch.cat([full, tiny, torch.zeros(256), vals[:100]]).contiguous()


def _assert_fp8_quantizes_like_reference(signed: bool, isa: str | None = None) -> None:
    for x in (_fp8_adversarial(signed), _ordinary(signed)):
        got = fp8_quantize_blockwise_cpp(x, signed, isa)
        codes, absmax = fp8_quantize_blocks(blocks_view(x), signed)
        assert torch.equal(got[0], codes.reshape(-1)[: x.numel()]) and torch.equal(got[1], absmax)


@pytest.mark.parametrize("signed", [True, False])
def test_cpp_fp8_quantization_bit_identical(signed):
    """The vector encoder (full blocks) and the scalar one (the partial block): torch's
    casts' codes for the whole grid, its ties and their neighbours, zeros of both signs,
    subnormal codes and tiny inputs."""
    needs_cpu_extension()
    _assert_fp8_quantizes_like_reference(signed)


def test_cpp_quantization_rejects_negative_second_moments():
    needs_cpu_extension()
    with pytest.raises(RuntimeError, match=r"x\[3\]=-1 is negative"):
        quantize_blockwise_cpp(torch.tensor([0.0, 1.0, 2.0, -1.0]), signed=False)


def test_cpu_isa_override(monkeypatch):
    monkeypatch.setenv("OUTCORE_CPU_ISA", "default")
    assert cpu_isa() == "DEFAULT"
    monkeypatch.setenv("OUTCORE_CPU_ISA", "SSE9")
    with pytest.raises(ValueError, match="OUTCORE_CPU_ISA='SSE9' is not one of"):
        cpu_isa()


@pytest.mark.slow(ci=True)  # builds each level's extension once (~30-60 s each on 2 cores)
def test_every_isa_level_bit_identical_to_reference(monkeypatch):
    """Each ISA level this CPU runs (scalar, AVX2, AVX-512 with and without VBMI), both state
    formats: quantization and six update steps (a partial block, an all-zero block, negative
    zeros), fp32 and bf16-lean, equal the reference's bits."""
    with ThreadPoolExecutor(2) as pool:  # the levels' builds (~40 s each here), two at a time
        built = list(pool.map(cpu_extension, supported_isa_levels()))
    needs_cpu_extension("DEFAULT")
    assert all(e is not None for e in built)
    n = 256 * 97 + 13
    ref = {fmt: (_run("ref", n, 6, fmt), _run_lean(False, fmt=fmt)) for fmt in STATE_FORMATS}
    for isa in supported_isa_levels():
        for signed in (True, False):
            _assert_quantizes_like_reference(signed, isa)
            _assert_fp8_quantizes_like_reference(signed, isa)
        monkeypatch.setenv("OUTCORE_CPU_ISA", isa)
        assert cpu_isa() == isa
        for fmt, (run_ref, lean_ref) in ref.items():
            for a, b in zip(_run("cpp", n, 6, fmt), run_ref):
                assert torch.equal(a, b), (isa, fmt)
            for a, b in zip(_run_lean(True, fmt=fmt), lean_ref):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (isa, fmt)


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_update_many_equals_per_tensor(fmt):
    """One C++ call over tensors of different sizes (partial blocks) and step counts: the same
    bits as one call per tensor."""
    needs_cpu_extension()
    sizes, steps = [256 * 64, 4099, 256 * 97 + 13], [1, 3, 7]
    many = [_state(n, seed=i, fmt=fmt) for i, n in enumerate(sizes)]
    one = [[t.clone() for t in st] for st in many]
    for rnd in range(3):
        grads = [_grad(n, rnd + 10 * i) for i, n in enumerate(sizes)]
        cs = [coefficients(HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], s + rnd)
              for s in steps]
        assert adamw8bit_update_many([st[0] for st in many], grads,
                                     *[[st[k] for st in many] for k in range(1, 5)], cs, state_format=fmt)
        for st, g, s in zip(one, grads, steps):
            adamw8bit_update(st[0], g, *st[1:], step=s + rnd, impl="cpp", state_format=fmt, **HP)
    for a, b in zip(many, one):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_lean_update_equals_widen_update_round(threads, fmt):
    """bf16-lean in one C++ call (weights and gradients bf16, rounded back stochastically block
    by block), on 1 or 2 threads: the bits of widening, the reference update and the rounding's
    reference, per tensor (partial blocks, tensors of many blocks, offsets, 64-bit keys)."""
    needs_cpu_extension()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = _run_lean(True, fmt=fmt)
    finally:
        torch.set_num_threads(old)
    ref = _run_lean(False, fmt=fmt)
    for a, b in zip(fused, ref):
        assert a[0].dtype == torch.bfloat16
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(fused[0][0], _state(LEAN_SIZES[0])[0].to(torch.bfloat16))  # the weights moved


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_auto_is_the_op(fmt):
    """impl="auto" (the custom op) runs the C++ kernel where it builds, else the reference."""
    want = _run("cpp" if cpu_extension() is not None else "ref", 5000, 4, fmt)
    for a, b in zip(_run("auto", 5000, 4, fmt), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_reference_tracks_fp32_adamw(fmt):
    """Quantized moments change the trajectory only slightly (tolerance: quantization)."""
    n = 256 * 40
    st = _state(n, fmt=fmt)
    p = torch.nn.Parameter(st[0].clone())
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"])
    for t in range(1, 21):
        g = _grad(n, t)
        adamw8bit_update(st[0], g, *st[1:], step=t, impl="ref", state_format=fmt, **HP)
        p.grad = g
        opt.step()
    start = _state(n)[0]
    moved = (p.detach() - start).norm()
    assert float((st[0] - p.detach()).norm() / moved) < 0.05
    m = (dequantize_blockwise(st[1], st[2], dynamic_map(True)) if fmt == "dynamic"
         else fp8_dequantize_blocks(blocks_view(st[1]), st[2], True).reshape(-1))
    exp_avg = opt.state[p]["exp_avg"]
    # measured 0.024 (dynamic) and 0.059 (fp8: E4M3 rounds to 3 mantissa bits, up to 2^-4
    # relative per requantization; the dynamic map is finer next to each block's absmax)
    assert float((m - exp_avg).norm() / exp_avg.norm()) < (0.04 if fmt == "dynamic" else 0.08)


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
    with pytest.raises(ValueError, match="state_format='fp4' is not one of"):
        adamw8bit_update(st[0], _grad(1000, 1), *st[1:], step=1, state_format="fp4", **HP)


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_op_schema_and_fake_impl(fmt):
    st = _state(3000, fmt=fmt)
    torch.library.opcheck(torch.ops.outcore.adamw8bit_update.default,
                          (st[0], _grad(3000, 1), *st[1:], 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, fmt),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow  # ~40 s of Inductor compilation on 2 cores
@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_torch_compile_bit_identical_to_reference(fmt):
    ref, comp = _run("ref", 256 * 30 + 7, 3, fmt), _run("compile", 256 * 30 + 7, 3, fmt)
    for a, b in zip(ref, comp):
        assert torch.equal(a, b)


def _triton_check_inputs(fmt):
    """The Triton check's start state and its steps' (grad, coefficients).

    The state holds every finite code of the format (random absmax): each code is decoded.
    Step 1 makes each moment its gradient's (beta1 = beta2 = 0 and 1 - beta2 = 7/8, coefficients
    no real beta2 gives: m = g, v = (g * g) * 7/8), so the encoder sees the format's adversarial
    values: for m the quantization tests' (``_adversarial``, ``_fp8_adversarial``: blocks whose
    absmax makes y = m; ties between neighbouring codes and the floats next to them, subnormal
    codes, zeros of both signs, tiny values, an all-zero block), for v the square roots of the
    unsigned ones (an FP8 block's max, 57344, is 256^2 * 7/8: y = v, and 46 of the 123 E5M2
    ties are hit exactly, the others missed by an ulp or so); last a partial block. Steps 2-5:
    ordinary AdamW steps with gradient scales jumping by 10^4, an all-zero block, negative zeros.
    """
    adversarial = _fp8_adversarial if fmt == "fp8" else _adversarial
    v_part = (adversarial(False).double() / 0.875).sqrt().float()
    g1 = torch.cat([torch.nn.functional.pad(v_part, (0, (-v_part.numel()) % 256)), adversarial(True),
                    _grad(5, 0)])
    n, nb = g1.numel(), num_blocks(g1.numel())
    state = _state(n, fmt=fmt)
    if fmt == "fp8":  # the finite codes: E4M3 all but the NaNs (0x7F, 0xFF), E5M2 below inf (0x7C)
        m_codes = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=torch.uint8)
        v_codes = torch.arange(0x7C, dtype=torch.uint8)
    else:
        m_codes = v_codes = torch.arange(256, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(7)
    for k, codes in ((1, m_codes), (3, v_codes)):
        state[k] = codes.repeat(n // codes.numel() + 1)[:n].contiguous()
        state[k + 1] = torch.rand(nb, generator=gen) * 10.0 ** torch.randint(-8, 3, (nb,), generator=gen)
    steps = [(g1, coefficients(HP["lr"], 0.0, 0.0, HP["eps"], HP["weight_decay"], 1)._replace(one_minus_beta2=0.875))]
    for t in range(2, 6):
        g = _grad(n, t, scale=10.0 ** (t % 5 - 3))
        if t == 3:
            g[:300] = 0
        if t == 4:
            g[:100] = -0.0
        steps.append((g, coefficients(HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], t)))
    return state, [(g, tuple(c)) for g, c in steps]


_TRITON_CHECK = r"""
import torch
from outcore.kernels.adamw8bit import Coefficients, adamw8bit_update_ref
from outcore.kernels.adamw8bit_triton import adamw8bit_update_triton
fmt, a, steps = torch.load(INPUTS)
b = [t.clone() for t in a]
for s, (grad, c) in enumerate(steps, 1):
    c = Coefficients(*c)
    adamw8bit_update_ref(a[0], grad, *a[1:], c, fmt)
    adamw8bit_update_triton(b[0], grad, *b[1:], c, fmt)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), s
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_triton_bit_identical_in_interpreter(fmt, run_in_triton_interpreter, tmp_path):
    """The Triton kernel (interpreted) equals the reference bit for bit, step after step, from
    a state holding every code, through adversarial and ordinary steps (``_triton_check_inputs``)."""
    inputs = tmp_path / "inputs.pt"
    torch.save((fmt, *_triton_check_inputs(fmt)), inputs)
    out = run_in_triton_interpreter(_TRITON_CHECK.replace("INPUTS", repr(str(inputs))))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_cuda_update_bit_identical_to_cpu_reference(fmt):
    n = 256 * 1000 + 3
    cpu = _state(n, fmt=fmt)
    gpu = [t.cuda() for t in cpu]
    for t in range(1, 5):
        g = _grad(n, t)
        adamw8bit_update(cpu[0], g, *cpu[1:], step=t, impl="ref", state_format=fmt, **HP)
        adamw8bit_update(gpu[0], g.cuda(), *gpu[1:], step=t, state_format=fmt, **HP)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
