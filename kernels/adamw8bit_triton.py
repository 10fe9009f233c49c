"""Triton impl of the fused 8-bit AdamW update (``kernels/adamw8bit.py``), for CUDA, in both
state formats (the dynamic maps, FP8).

Bit-identical to the reference: IEEE ``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and
``sqrt`` are approximate on CUDA), ``enable_fp_fusion=False`` (no FMA where the reference
rounds twice), fp32 scalars rounded from the same Python floats. One program updates
``BLOCKS`` quantization blocks (a [BLOCKS, 256] tile): dequantize, update, new absmax per
row, requantize. The dynamic codes go through the map and the bucket table
(``kernels/quantize_triton.py``); the FP8 codes are decoded and encoded with integer
operations on fp32 bits, as the C++ kernel does (``kernels/csrc/adamw8bit_fp8.h``), not with
Triton's float8 casts, whose availability and rounding depend on the GPU architecture (and
which the interpreter emulates differently). Tested on CPU with ``TRITON_INTERPRET=1``; run on
a GPU by the ``gpu`` tests. Imports triton: imported lazily by ``kernels/adamw8bit.py`` only
where it launches.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._library import pick_config
from .quantize import BLOCKSIZE, num_blocks
from .quantize_fp8 import ABSMAX_FLOOR, fp8_max
from .quantize_triton import quantize_codes, triton_cdiv

_CONFIGS = [{"BLOCKS": 4, "num_warps": 4}]
_INTERPRET_DEFAULT = {"BLOCKS": 64, "num_warps": 4}

# The FP8 formats (as Fp8Format in adamw8bit_fp8.h): mantissa bits, exponent bias, largest value.
_E4M3_MANT, _E4M3_BIAS, _E4M3_MAX = tl.constexpr(3), tl.constexpr(7), tl.constexpr(fp8_max(True))
_E5M2_MANT, _E5M2_BIAS, _E5M2_MAX = tl.constexpr(2), tl.constexpr(15), tl.constexpr(fp8_max(False))
_FLOOR = tl.constexpr(ABSMAX_FLOOR)


@triton.jit
def _fp8_decode(code, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The exact fp32 values of FP8 ``code`` (uint8 tile), as ``fp8_decode``: a normal code's
    bits moved into place with the exponent rebiased; a subnormal one (exponent 0) as the
    normal with exponent 1 minus the implicit one (exact)."""
    c = code.to(tl.uint32)
    mag = (c & 0x7F) << (23 - MANT)
    sub = mag < (1 << 23)
    f = (mag + ((127 - BIAS) << 23) + tl.where(sub, 1 << 23, 0)).to(tl.float32, bitcast=True)
    f = f - tl.where(sub, 2.0 ** (1 - BIAS), 0.0)
    return (f.to(tl.uint32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_encode(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 codes (uint8) of fp32 ``y``, rounded to nearest even as torch's cast, for
    finite ``|y| <= max * (1 + 2^-21)``, as ``fp8_encode``. Normal results: integer rounding
    of the fp32 bits (add half an FP8 ulp minus one, plus the kept lowest bit, and truncate).
    Subnormal ones: adding 2^(24 - BIAS - MANT), whose fp32 ulp is the FP8 subnormal step,
    rounds the magnitude to that step (the float add's nearest-even); the sum's low bits are
    the code. The sign bit is copied (-0.0 gets code 0x80, as the cast gives)."""
    SHIFT: tl.constexpr = 23 - MANT
    MIN_NORMAL: tl.constexpr = (128 - BIAS) << 23
    DENORM: tl.constexpr = (127 + 24 - BIAS - MANT) << 23
    bits = y.to(tl.uint32, bitcast=True)
    a = bits & 0x7FFFFFFF
    dn = tl.full(y.shape, DENORM, tl.uint32)
    r_sub = (a.to(tl.float32, bitcast=True) + dn.to(tl.float32, bitcast=True)).to(tl.uint32, bitcast=True) - dn
    # a < MIN_NORMAL wraps below the rebias: that lane takes r_sub
    r_norm = (a - ((127 - BIAS) << 23) + (2 ** (SHIFT - 1) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    r = tl.where(a < MIN_NORMAL, r_sub, r_norm)
    return (r | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _update(p_ptr, g_ptr, mc_ptr, ma_ptr, vc_ptr, va_ptr, qm_ptr, qv_ptr, bm_ptr, tm_ptr,
            bv_ptr, tv_ptr, n, nblocks, zero_m, zero_v, beta1, omb1, beta2, omb2, ibc2, eps,
            step_size, decay, FP8: tl.constexpr, BLOCKS: tl.constexpr, BS: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)
    bmask = blk < nblocks
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    # padding gets the code of 0, so it cannot raise a partial block's absmax
    mc = tl.load(mc_ptr + offs, mask=mask, other=zero_m)
    vc = tl.load(vc_ptr + offs, mask=mask, other=zero_v)
    am = tl.load(ma_ptr + blk, mask=bmask, other=0.0)
    av = tl.load(va_ptr + blk, mask=bmask, other=0.0)
    if FP8:  # value = code's value * (absmax / FP8_MAX), a true division as the reference's
        sm = tl.math.div_rn(am, tl.full([BLOCKS], _E4M3_MAX, tl.float32))
        sv = tl.math.div_rn(av, tl.full([BLOCKS], _E5M2_MAX, tl.float32))
        m = _fp8_decode(mc, _E4M3_MANT, _E4M3_BIAS) * sm[:, None]
        v = _fp8_decode(vc, _E5M2_MANT, _E5M2_BIAS) * sv[:, None]
    else:
        m = tl.load(qm_ptr + mc.to(tl.int32)) * am[:, None]
        v = tl.load(qv_ptr + vc.to(tl.int32)) * av[:, None]
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    denom = tl.sqrt_rn(v) * ibc2 + eps
    p = p * decay - tl.math.div_rn(m, denom) * step_size
    tl.store(p_ptr + offs, p, mask=mask)
    new_am = tl.max(tl.abs(m), axis=1)
    new_av = tl.max(tl.abs(v), axis=1)
    if FP8:  # y = x * (FP8_MAX / max(absmax, floor)): the floor keeps the multiplier finite
        inv_m = tl.math.div_rn(tl.full([BLOCKS], _E4M3_MAX, tl.float32), tl.maximum(new_am, _FLOOR))
        inv_v = tl.math.div_rn(tl.full([BLOCKS], _E5M2_MAX, tl.float32), tl.maximum(new_av, _FLOOR))
        cm = _fp8_encode(m * inv_m[:, None], _E4M3_MANT, _E4M3_BIAS)
        cv = _fp8_encode(v * inv_v[:, None], _E5M2_MANT, _E5M2_BIAS)
    else:
        one = tl.full([BLOCKS], 1.0, tl.float32)
        inv_m = tl.math.div_rn(one, tl.where(new_am > 0, new_am, 1.0))
        inv_v = tl.math.div_rn(one, tl.where(new_av > 0, new_av, 1.0))
        cm = quantize_codes(m * inv_m[:, None], bm_ptr, tm_ptr)
        cv = quantize_codes(v * inv_v[:, None], bv_ptr, tv_ptr)
    tl.store(mc_ptr + offs, cm.to(tl.uint8), mask=mask)
    tl.store(vc_ptr + offs, cv.to(tl.uint8), mask=mask)
    tl.store(ma_ptr + blk, new_am, mask=bmask)
    tl.store(va_ptr + blk, new_av, mask=bmask)


def adamw8bit_update_triton(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                            v_codes: Tensor, v_absmax: Tensor, c, state_format: str) -> None:
    """In-place 8-bit AdamW update with Triton (see ``adamw8bit_update_ref`` for the contract).

    Args:
        param, grad: (n,) float32, contiguous.     m_codes, v_codes: (n,) uint8.
        m_absmax, v_absmax: (ceil(n/256),) float32. c: the step's ``Coefficients``.
        state_format: ``"dynamic"`` or ``"fp8"`` (``kernels/adamw8bit.py: STATE_FORMATS``).

    Raises:
        ValueError: an unknown ``state_format``.
    """
    from .adamw8bit import _tables, _zero_code, check_state_format

    check_state_format(state_format)
    n, nb = param.numel(), num_blocks(param.numel())
    qm, qv, bm, tm, bv, tv = _tables(param.device)  # unread by the FP8 kernel
    cfg = pick_config(_CONFIGS, _INTERPRET_DEFAULT)
    _update[(triton_cdiv(nb, cfg["BLOCKS"]),)](
        param, grad, m_codes, m_absmax, v_codes, v_absmax, qm, qv, bm, tm, bv, tv, n, nb,
        _zero_code(True, state_format), _zero_code(False, state_format), *c,
        FP8=state_format == "fp8", BLOCKS=cfg["BLOCKS"], BS=BLOCKSIZE,
        num_warps=cfg["num_warps"], enable_fp_fusion=False)
