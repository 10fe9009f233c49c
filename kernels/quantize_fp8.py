"""Block-wise FP8 quantization: the ``"fp8"`` state format of the 8-bit AdamW update.

Blocks of ``BLOCKSIZE`` (256) elements, one fp32 absmax each (as the dynamic format,
``kernels/quantize.py``), and every element an FP8 code: the first moment (signed) as
``float8_e4m3fn``, the second (``>= 0``) as ``float8_e5m2``, the choice of Fishman et al.,
"Scaling FP8 training to trillion-token LLMs" (2024): the second moment spans squared
gradients and needs E5M2's range more than a third mantissa bit. torchao's ``AdamWFp8``
keeps both in E4M3.

Exact definitions (the C++ update reproduces them bit for bit; ``kernels/csrc/adamw8bit_fp8.h``):

* ``dequantize(code) = fp8_value(code) * (absmax / FP8_MAX)`` (fp32 division, then one product),
* ``code = fp8(y)`` with ``y = x * (FP8_MAX / max(absmax, 2^-100))``: torch's cast, round to
  nearest even (the floor keeps the multiplier finite; an all-zero block stays zero).

Why a second format: its codes are a float's top bits, so the CPU decodes and encodes them
with a few vector instructions (F16C's fp16 conversions), where the dynamic map needs a
table lookup and a search per element (``docs/benchmarks.md``: the AVX2 update).
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPES = {True: torch.float8_e4m3fn, False: torch.float8_e5m2}  # signed -> codes' dtype
ABSMAX_FLOOR = 2.0 ** -100


def fp8_max(signed: bool) -> float:
    """The largest finite value of the format's codes: 448 (E4M3), 57344 (E5M2)."""
    return float(torch.finfo(FP8_DTYPES[signed]).max)


def fp8_dequantize_blocks(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """(nblocks, blocksize) uint8 codes and their (nblocks,) absmax -> fp32 values."""
    # tensor / tensor: a true division on every device (CUDA computes ``tensor / Python scalar``
    # as a product with the scalar's fp32 reciprocal, one ulp off for about half the scales)
    scale = absmax / torch.full_like(absmax, fp8_max(signed))
    return codes.view(FP8_DTYPES[signed]).float() * scale[:, None]


def fp8_quantize_blocks(blocks: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """Rows of ``blocks`` (float32) -> codes (uint8, same shape) and absmax per row.

    ``signed`` False is for values ``>= 0`` (E5M2 has a sign bit; it is simply never set).
    """
    absmax = blocks.abs().amax(dim=1)
    # a true division (torch computes ``scalar / tensor`` as a reciprocal times the scalar)
    inv = torch.full_like(absmax, fp8_max(signed)) / absmax.clamp(min=ABSMAX_FLOOR)
    return (blocks * inv[:, None]).to(FP8_DTYPES[signed]).view(torch.uint8), absmax
