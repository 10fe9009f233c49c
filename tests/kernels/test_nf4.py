"""NF4 quantization (``kernels/nf4.py``): the C++ kernel, the reference and bitsandbytes give
the same codes and scales, on ordinary and adversarial values (midpoints and their neighbours,
zero blocks, tiny and huge scales), for fp32 and bf16 input."""
from __future__ import annotations

import pytest
import torch

from outcore.kernels.nf4 import NF4_BLOCK, NF4_LEVELS, nf4_bounds, nf4_quantize, nf4_quantize_ref
from tests._helpers import needs_cpu_extension

bnb = pytest.importorskip("bitsandbytes.functional")


def _adversarial() -> torch.Tensor:
    """Blocks whose scaled values sit on the NF4 midpoints, one ulp either side, and on the levels."""
    b = nf4_bounds()
    near = torch.cat([b, torch.nextafter(b, torch.tensor(2.0)), torch.nextafter(b, torch.tensor(-2.0)),
                      torch.tensor(NF4_LEVELS)])
    rows = []
    for scale in (1.0, 0.02, 3e-39, 1e30):
        for start in range(0, near.numel(), NF4_BLOCK - 1):
            chunk = near[start:start + NF4_BLOCK - 1]
            row = torch.zeros(NF4_BLOCK)
            row[0] = 1.0  # the block's absmax: the others are scaled by exactly 1
            row[1:1 + chunk.numel()] = chunk
            rows.append(row * scale)
    rows.append(torch.zeros(NF4_BLOCK))  # absmax 0: clamped to 1e-38, every code the level 0.0
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_and_bitsandbytes(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1 << 16, generator=g) * 0.02, _adversarial()]).to(dtype)
    packed, absmax = nf4_quantize(x)
    ref_packed, ref_absmax = nf4_quantize_ref(x)
    theirs, state = bnb.quantize_4bit(x.float().view(-1, NF4_BLOCK), blocksize=NF4_BLOCK, quant_type="nf4")
    assert torch.equal(packed, ref_packed) and torch.equal(absmax, ref_absmax)
    assert torch.equal(packed, theirs.view(-1)) and torch.equal(absmax, state.absmax)


def test_the_cpp_kernel_is_the_one_that_ran():
    ext = needs_cpu_extension()
    x = torch.randn(4 * NF4_BLOCK)
    packed, absmax = torch.empty(2 * NF4_BLOCK, dtype=torch.uint8), torch.empty(4)
    ext.nf4_quantize(x, nf4_bounds(), packed, absmax)
    assert torch.equal(packed, nf4_quantize_ref(x)[0])


def test_the_levels_are_bitsandbytes():
    assert torch.equal(torch.tensor(NF4_LEVELS), bnb.get_4bit_type("nf4", device="cpu"))


def test_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 64"):
        nf4_quantize(torch.zeros(100))
