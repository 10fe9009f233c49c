"""Triton kernel for ``outcore::zo_perturb_`` on CUDA.

Same contract as the reference in :mod:`outcore.kernels.zo_perturb`
(``w = src + fl32(scale * z) * mask``), but ``z`` comes from Triton's Philox
stream (``tl.randn(seed, offset)``), not torch's generator: a run trained on this
backend replays bit-for-bit on this backend only. Each program handles
``BLOCK`` elements; the offset of an element is its flat index, so the values do
not depend on ``BLOCK`` or on the launch grid. Large tiles keep the interpreter
(``TRITON_INTERPRET=1``) usable on CPU for tests.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 4096  # elements per program


@functools.lru_cache(maxsize=1)
def _kernel():
    """Build the kernel on first use (no Triton work at import time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def zo_perturb_kernel(w_ptr, src_ptr, mask_ptr, n, seed, scale,
                          HAS_MASK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        valid = offs < n
        z = tl.randn(seed, offs.to(tl.int32))  # Philox; offsets wrap above 2**31 elements
        d = z * scale
        if HAS_MASK:
            m = tl.load(mask_ptr + offs, mask=valid, other=0).to(tl.float32)
            d = d * m
        s = tl.load(src_ptr + offs, mask=valid, other=0.0)
        out = s + d.to(s.dtype)
        tl.store(w_ptr + offs, out, mask=valid)

    return zo_perturb_kernel


def zo_perturb_triton_(w: torch.Tensor, seed: int, scale: float, mask: torch.Tensor | None,
                       src: torch.Tensor | None) -> None:
    """``w = src + scale * z(seed) * mask`` with the Triton kernel.

    Args:
        w: contiguous float tensor (any shape), written in place.
        seed: tensor seed; folded to 31 bits for Philox.
        scale: multiplier of z.
        mask: optional 0/1 tensor of ``w``'s shape.
        src: optional clean tensor of ``w``'s shape (defaults to ``w``).
    """
    import triton

    n = w.numel()
    if n == 0:
        return
    src_t = w if src is None else src.contiguous()
    mask_t = mask.contiguous() if mask is not None else w  # dummy pointer when HAS_MASK is False
    if mask is not None and mask.dtype == torch.bool:
        mask_t = mask_t.view(torch.uint8)
    grid = (triton.cdiv(n, BLOCK),)
    _kernel()[grid](w, src_t, mask_t, n, int(seed) & 0x7FFFFFFF, float(scale),
                    HAS_MASK=mask is not None, BLOCK_SIZE=BLOCK)
