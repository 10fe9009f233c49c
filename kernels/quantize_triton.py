"""Triton impls of block-wise 8-bit quantize / dequantize (``kernels/quantize.py``).

Same numerics as the reference, bit for bit: IEEE division (``div_rn``; Triton's ``/`` is
approximate on CUDA), the table method for rounding to the nearest map entry, and no FMA
contraction where the reference rounds twice. Each program handles ``BLOCKS`` quantization
blocks of 256 elements as one 2-D tile. Tested on CPU with ``TRITON_INTERPRET=1``.

This module imports triton: import it only where a Triton launch is about to happen
(``kernels/quantize.py`` does so lazily), never at outcore import time (docs/architecture.md §13).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._library import pick_config
from .quantize import (BLOCKSIZE, BUCKET_BITS_MAX, BUCKET_BITS_MIN, BUCKETS_PER_SIGN, bucket_table,
                       num_blocks, thresholds)

_CONFIGS = [{"BLOCKS": 4, "num_warps": 4}]
_INTERPRET_DEFAULT = {"BLOCKS": 64, "num_warps": 4}  # big tiles: the interpreter pays per program


_BMIN = tl.constexpr(BUCKET_BITS_MIN)
_BMAX = tl.constexpr(BUCKET_BITS_MAX)
_PER_SIGN = tl.constexpr(BUCKETS_PER_SIGN)


@triton.jit
def quantize_codes(y, table_ptr, thr_ptr):
    """Codes of normalized values ``y`` (any tile shape) by the bucket-table method."""
    bits = y.to(tl.int32, bitcast=True)
    mag = (bits & 0x7FFFFFFF) >> 16
    mag = tl.minimum(tl.maximum(mag, _BMIN), _BMAX) - _BMIN
    idx = mag + tl.where(bits < 0, _PER_SIGN, 0)
    c = tl.load(table_ptr + idx).to(tl.int32)
    t = tl.load(thr_ptr + c)
    return c + (y > t).to(tl.int32)


@triton.jit
def _quantize(x_ptr, codes_ptr, absmax_ptr, table_ptr, thr_ptr, n, nblocks,
              BLOCKS: tl.constexpr, BS: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.math.div_rn(tl.full([BLOCKS], 1.0, tl.float32), tl.where(amax > 0, amax, 1.0))
    code = quantize_codes(x * inv[:, None], table_ptr, thr_ptr)
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + blk, amax, mask=blk < nblocks)


@triton.jit
def _dequantize(codes_ptr, absmax_ptr, qmap_ptr, out_ptr, n, nblocks,
                BLOCKS: tl.constexpr, BS: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = offs < n
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    a = tl.load(absmax_ptr + blk, mask=blk < nblocks, other=0.0)
    tl.store(out_ptr + offs, tl.load(qmap_ptr + c) * a[:, None], mask=mask)


def _signed(qmap: Tensor) -> bool:
    return bool(qmap[0] < 0)


def quantize_blockwise_triton(x: Tensor, qmap: Tensor, blocksize: int = BLOCKSIZE) -> tuple[Tensor, Tensor]:
    """Triton :func:`~outcore.kernels.quantize.quantize_blockwise` for a dynamic map.

    Args:
        x: contiguous float tensor (CUDA, or CPU under TRITON_INTERPRET=1).
        qmap: (256,) the signed or unsigned dynamic map.
        blocksize: must be 256.

    Returns:
        codes (numel,) uint8 and absmax (nblocks,) float32.

    Raises:
        ValueError: another block size.
    """
    if blocksize != BLOCKSIZE:
        raise ValueError(f"the Triton kernel supports blocksize={BLOCKSIZE}, got {blocksize}")
    n, nb = x.numel(), num_blocks(x.numel())
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(nb, dtype=torch.float32, device=x.device)
    cfg = pick_config(_CONFIGS, _INTERPRET_DEFAULT)
    grid = (triton_cdiv(nb, cfg["BLOCKS"]),)
    _quantize[grid](x.reshape(-1), codes, absmax, bucket_table(_signed(qmap), x.device),
                thresholds(qmap), n, nb, BLOCKS=cfg["BLOCKS"], BS=BLOCKSIZE,
                num_warps=cfg["num_warps"], enable_fp_fusion=False)
    return codes, absmax


def dequantize_blockwise_triton(codes: Tensor, absmax: Tensor, qmap: Tensor,
                                blocksize: int = BLOCKSIZE) -> Tensor:
    """Triton :func:`~outcore.kernels.quantize.dequantize_blockwise`: (n,) float32."""
    if blocksize != BLOCKSIZE:
        raise ValueError(f"the Triton kernel supports blocksize={BLOCKSIZE}, got {blocksize}")
    n, nb = codes.numel(), num_blocks(codes.numel())
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    cfg = pick_config(_CONFIGS, _INTERPRET_DEFAULT)
    _dequantize[(triton_cdiv(nb, cfg["BLOCKS"]),)](codes.reshape(-1), absmax, qmap, out, n, nb,
                                               BLOCKS=cfg["BLOCKS"], BS=BLOCKSIZE,
                                               num_warps=cfg["num_warps"])
    return out


def triton_cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return (a + b - 1) // b
