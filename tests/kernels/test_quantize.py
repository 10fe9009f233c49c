"""Block-wise 8-bit quantization: maps, the table method, the ops, Triton (interpreter)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from outcore.kernels.quantize import (BLOCKSIZE, bucket_table, dequantize_blockwise, dynamic_map,
                                      num_blocks, quantize_blockwise, quantize_with_table,
                                      thresholds)


@pytest.mark.parametrize("signed", [True, False])
def test_maps_equal_bitsandbytes(signed):
    """bitsandbytes computes its map with torch.linspace: the pinned values where torch runs the
    vectorized kernel (x86 AVX2 / AVX-512)."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch's scalar linspace here: bitsandbytes' map is 1-2 ulps off in places")
    assert torch.equal(dynamic_map(signed), bnbf.create_dynamic_map(signed=signed).float())


_MAP_DIGEST = ("import hashlib; from outcore.kernels.quantize import dynamic_map; "
               "print(hashlib.sha1(b''.join(dynamic_map(s).numpy().tobytes() for s in (True, False))).hexdigest())")


def test_maps_do_not_depend_on_the_cpu_capability():
    """The maps a run writes codes against are the same whether torch runs its vectorized or its
    scalar kernels (a checkpoint written on one host decodes alike on another)."""
    digests = set()
    for capability in ("default", "avx2"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        out = subprocess.run([sys.executable, "-c", _MAP_DIGEST], env=env, check=True,
                             stdout=subprocess.PIPE, text=True).stdout.split()
        digests.add(out[-1])
    assert len(digests) == 1, digests


@pytest.mark.parametrize("signed", [True, False])
def test_table_method_equals_searchsorted(signed):
    q = dynamic_map(signed)
    t = thresholds(q)
    g = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-12, 3, (100_000,), generator=g)
    y = torch.cat([torch.randn(100_000, generator=g) * scale, q, t[:255],
                   torch.nextafter(t[:255], torch.tensor(9.0)),
                   torch.nextafter(t[:255], torch.tensor(-9.0)),
                   torch.tensor([0.0, -0.0, 1e-38, -1e-38, 2.0, -2.0, 1e30, -1e30])])
    if not signed:
        y = y.abs()
    want = torch.searchsorted(t[:255].contiguous(), y, side="left").to(torch.uint8)
    assert torch.equal(quantize_with_table(y, bucket_table(signed), t), want)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 5000])
def test_round_trip_error_is_bounded(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    codes, absmax = quantize_blockwise(x)
    assert codes.shape == (n,) and codes.dtype == torch.uint8
    assert absmax.shape == (num_blocks(n),)
    y = dequantize_blockwise(codes, absmax, shape=x.shape)
    # the dynamic map's spacing near 1 is 0.9/64 of absmax: half of it bounds the error
    err = (x - y).abs().view(-1)
    bound = (absmax.repeat_interleave(BLOCKSIZE)[:n] * 0.9 / 64 / 2) * 1.0001
    assert bool((err <= bound).all())
    # a positive block maximum is represented exactly (the signed map has 1.0, not -1.0)
    pos = x.view(-1).abs().argmax()
    if x.view(-1)[pos] > 0:
        assert y.view(-1)[pos] == x.view(-1)[pos]


def test_exact_values_and_zero_blocks():
    q = dynamic_map(True)
    x = torch.cat([q * 3.0, torch.zeros(256)])
    codes, absmax = quantize_blockwise(x)
    assert absmax[1] == 0 and bool((dequantize_blockwise(codes, absmax)[256:] == 0).all())
    assert torch.equal(codes[:256], torch.arange(256, dtype=torch.uint8))
    assert torch.equal(dequantize_blockwise(codes, absmax)[:256], q * 3.0)


def test_unsigned_map_for_nonnegative_values():
    x = torch.rand(1000) * 1e-3
    qv = dynamic_map(False)
    codes, absmax = quantize_blockwise(x, qv)
    rel = ((dequantize_blockwise(codes, absmax, qv) - x).abs() / absmax.repeat_interleave(256)[:1000])
    assert float(rel.max()) <= 0.9 / 128 / 2 * 1.0001


def test_ops_are_registered_with_fake_impls():
    x = torch.randn(700)
    q = dynamic_map(True)
    torch.library.opcheck(torch.ops.outcore.quantize_blockwise.default, (x, q, 256))
    c, a = quantize_blockwise(x)
    torch.library.opcheck(torch.ops.outcore.dequantize_blockwise.default, (c, a, q, 256))


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="torch.int64"):
        quantize_blockwise(torch.arange(10))
    with pytest.raises(ValueError, match="blocksize=100"):
        quantize_blockwise(torch.randn(10), blocksize=100)
    with pytest.raises(ValueError, match=r"shape \(10,\)"):
        quantize_blockwise(torch.randn(10), torch.zeros(10))
    with pytest.raises(ValueError, match="torch.float32"):
        dequantize_blockwise(torch.zeros(10), torch.zeros(1))
    with pytest.raises(ValueError, match="absmax has 3 entries"):
        dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(3))


_TRITON_CHECK = r"""
import torch
from outcore.kernels.quantize import dynamic_map, quantize_blockwise, dequantize_blockwise
from outcore.kernels.quantize_triton import quantize_blockwise_triton, dequantize_blockwise_triton
x = torch.randn(20_001, generator=torch.Generator().manual_seed(0)) * 3
for signed in (True, False):
    q = dynamic_map(signed)
    xx = x if signed else x.abs()
    c1, a1 = quantize_blockwise_triton(xx, q)
    c2, a2 = quantize_blockwise(xx, q)
    assert torch.equal(c1, c2) and torch.equal(a1, a2)
    assert torch.equal(dequantize_blockwise_triton(c1, a1, q), dequantize_blockwise(c2, a2, q))
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_quantize_bit_identical_in_interpreter(run_in_triton_interpreter):
    out = run_in_triton_interpreter(_TRITON_CHECK)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_ops_bit_identical_to_cpu_reference():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    for signed in (True, False):
        q = dynamic_map(signed)
        xx = x if signed else x.abs()
        c_cpu, a_cpu = quantize_blockwise(xx, q)
        c_gpu, a_gpu = quantize_blockwise(xx.cuda(), q.cuda())
        assert torch.equal(c_gpu.cpu(), c_cpu) and torch.equal(a_gpu.cpu(), a_cpu)
        assert torch.equal(dequantize_blockwise(c_gpu, a_gpu, q.cuda()).cpu(),
                           dequantize_blockwise(c_cpu, a_cpu, q))
