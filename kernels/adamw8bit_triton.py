"""Triton impl of the fused 8-bit AdamW update (``kernels/adamw8bit.py``), for CUDA.

Bit-identical to the reference: IEEE ``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and
``sqrt`` are approximate on CUDA), ``enable_fp_fusion=False`` (no FMA where the reference
rounds twice), fp32 scalars rounded from the same Python floats. One program updates
``BLOCKS`` quantization blocks (a [BLOCKS, 256] tile): dequantize, update, new absmax per
row, requantize. Tested on CPU with ``TRITON_INTERPRET=1``; run on a GPU by the ``gpu`` tests.
Imports triton: imported lazily by ``kernels/adamw8bit.py`` only where it launches.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._library import pick_config
from .quantize import BLOCKSIZE, num_blocks
from .quantize_triton import quantize_codes, triton_cdiv

_CONFIGS = [{"BLOCKS": 4, "num_warps": 4}]
_INTERPRET_DEFAULT = {"BLOCKS": 64, "num_warps": 4}


@triton.jit
def _update(p_ptr, g_ptr, mc_ptr, ma_ptr, vc_ptr, va_ptr, qm_ptr, qv_ptr, bm_ptr, tm_ptr,
            bv_ptr, tv_ptr, n, nblocks, zero_m, zero_v, beta1, omb1, beta2, omb2, ibc2, eps,
            step_size, decay, BLOCKS: tl.constexpr, BS: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)
    bmask = blk < nblocks
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    # padding gets the code of 0, so it cannot raise a partial block's absmax
    mc = tl.load(mc_ptr + offs, mask=mask, other=zero_m).to(tl.int32)
    vc = tl.load(vc_ptr + offs, mask=mask, other=zero_v).to(tl.int32)
    am = tl.load(ma_ptr + blk, mask=bmask, other=0.0)
    av = tl.load(va_ptr + blk, mask=bmask, other=0.0)
    m = tl.load(qm_ptr + mc) * am[:, None]
    v = tl.load(qv_ptr + vc) * av[:, None]
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    denom = tl.sqrt_rn(v) * ibc2 + eps
    p = p * decay - tl.math.div_rn(m, denom) * step_size
    tl.store(p_ptr + offs, p, mask=mask)
    one = tl.full([BLOCKS], 1.0, tl.float32)
    new_am = tl.max(tl.abs(m), axis=1)
    new_av = tl.max(tl.abs(v), axis=1)
    inv_m = tl.math.div_rn(one, tl.where(new_am > 0, new_am, 1.0))
    inv_v = tl.math.div_rn(one, tl.where(new_av > 0, new_av, 1.0))
    cm = quantize_codes(m * inv_m[:, None], bm_ptr, tm_ptr)
    cv = quantize_codes(v * inv_v[:, None], bv_ptr, tv_ptr)
    tl.store(mc_ptr + offs, cm.to(tl.uint8), mask=mask)
    tl.store(vc_ptr + offs, cv.to(tl.uint8), mask=mask)
    tl.store(ma_ptr + blk, new_am, mask=bmask)
    tl.store(va_ptr + blk, new_av, mask=bmask)



def adamw8bit_update_triton(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                            v_codes: Tensor, v_absmax: Tensor, c) -> None:
    """In-place 8-bit AdamW update with Triton (see ``adamw8bit_update_ref`` for the contract).

    Args:
        param, grad: (n,) float32, contiguous.     m_codes, v_codes: (n,) uint8.
        m_absmax, v_absmax: (ceil(n/256),) float32. c: the step's ``Coefficients``.
    """
    from .adamw8bit import _tables, _zero_code

    n, nb = param.numel(), num_blocks(param.numel())
    qm, qv, bm, tm, bv, tv = _tables(param.device)
    cfg = pick_config(_CONFIGS, _INTERPRET_DEFAULT)
    _update[(triton_cdiv(nb, cfg["BLOCKS"]),)](
        param, grad, m_codes, m_absmax, v_codes, v_absmax, qm, qv, bm, tm, bv, tv, n, nb,
        _zero_code(True), _zero_code(False), *c, BLOCKS=cfg["BLOCKS"], BS=BLOCKSIZE,
        num_warps=cfg["num_warps"], enable_fp_fusion=False)
