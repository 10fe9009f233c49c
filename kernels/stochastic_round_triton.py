"""Triton kernel for ``outcore::stochastic_round_`` on CUDA (:mod:`outcore.kernels.stochastic_round`).

Bit-identical to the reference: the same hash in uint32 arithmetic (wrapping multiplies give
the low 32 bits the reference keeps), the same bits per element index, so the result does not
depend on ``BLOCK`` or the grid. Large tiles keep the interpreter (``TRITON_INTERPRET=1``)
usable on CPU for tests. Imports triton: imported lazily, only where it launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .stochastic_round import HASH_MULS, HASH_SHIFTS

BLOCK = 4096  # elements per program
_S0, _S1, _S2 = (tl.constexpr(s) for s in HASH_SHIFTS)
_M0, _M1 = (tl.constexpr(m) for m in HASH_MULS)


@triton.jit
def _hash32(h):
    h = h ^ (h >> _S0)
    h = h * _M0
    h = h ^ (h >> _S1)
    h = h * _M1
    return h ^ (h >> _S2)


@triton.jit
def _stochastic_round(out_ptr, x_ptr, n, start, key_lo, key_hi, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    valid = offs < n
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    idx = (offs + start).to(tl.uint32)  # the element's index in its tensor, mod 2^32
    r = (_hash32(idx ^ key_lo.to(tl.uint32)) ^ key_hi.to(tl.uint32)) >> 16
    bits = x.to(tl.uint32, bitcast=True)
    top = (bits + r) >> 16
    top = tl.where(x != x, bits >> 16, top)  # NaN: a carry could turn it into -0
    tl.store(out_ptr + offs, top.to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)


def stochastic_round_triton_(out: torch.Tensor, x: torch.Tensor, key: int, offset: int) -> None:
    """``out = SR(x)`` with the Triton kernel (arguments as ``stochastic_round_``).

    Args:
        out: contiguous bf16 tensor, written.
        x: contiguous fp32 tensor of ``out``'s shape.
        key: the rounding's key (< 2^63).
        offset: index of ``x``'s first element in its whole tensor.
    """
    n = x.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    _stochastic_round[grid](out.view(torch.int16), x, n, int(offset), int(key) & 0xFFFFFFFF,
                            (int(key) >> 32) & 0xFFFFFFFF, BLOCK_SIZE=BLOCK)
