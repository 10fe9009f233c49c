"""NF4 quantization (QLoRA's 4-bit NormalFloat), the bits of bitsandbytes' CPU quantizer.

Per block of ``NF4_BLOCK`` weights: ``absmax = max |x|``, ``y = clamp(x / absmax, -1, 1)``
in fp32 (as ``x * (1 / absmax)``), and the code is the index of the nearest of the 16 NF4
levels (``torch.bucketize`` over the 15 midpoints between them); two codes a byte, the
first in the high nibble. ``offload/engine/nf4.py`` stores a QLoRA base this way and
dequantizes it with bitsandbytes.

:func:`nf4_quantize` runs the C++ kernel (``csrc/nf4_cpu.h``, in the CPU extension of
``adamw8bit.py``) on the CPU: one pass over the weights, where the reference's bucketize
over fp32 copies does 6-14 M weights/s on two cores (1.4 to 3.5 hours for a 70B base). The
reference :func:`nf4_quantize_ref` is the fallback and what the tests hold it to.
"""
from __future__ import annotations

import functools

import torch

NF4_BLOCK = 64  # weights per absmax (QLoRA's block size)
#: the 16 NF4 levels (bitsandbytes' ``get_4bit_type("nf4")``: quantiles of N(0, 1), scaled to [-1, 1])
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


@functools.lru_cache(maxsize=1)
def nf4_bounds() -> torch.Tensor:
    """The 15 fp32 midpoints between consecutive NF4 levels (computed in fp32, as bitsandbytes)."""
    code = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    return (code[:-1] + code[1:]) / 2


def _check(x: torch.Tensor) -> None:
    if x.numel() % NF4_BLOCK:
        raise ValueError(f"NF4 quantizes whole blocks of {NF4_BLOCK}; got {x.numel()} elements")


def nf4_quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer (bitsandbytes' default ``quantize_4bit``, ``nf4``, blocksize 64).

    Args:
        x: any float tensor of a multiple of ``NF4_BLOCK`` elements.

    Returns:
        ``(packed [n / 2] uint8, absmax [n / 64] float32)``.

    Raises:
        ValueError: ``x`` is not whole blocks.
    """
    _check(x)
    a = x.reshape(-1, NF4_BLOCK).float()
    absmax = a.abs().max(dim=-1)[0]
    scaled = torch.clamp(a * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    q = torch.bucketize(scaled, nf4_bounds().to(x.device), out_int32=True).to(torch.uint8).view(-1, 2)
    return (q[:, 0] << 4) | q[:, 1], absmax


def nf4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nf4_quantize_ref`'s bits; on the CPU for fp32 / bf16 by the C++ kernel.

    Args:
        x: a float tensor of a multiple of ``NF4_BLOCK`` elements.

    Returns:
        ``(packed [n / 2] uint8, absmax [n / 64] float32)``.

    Raises:
        ValueError: ``x`` is not whole blocks.
    """
    _check(x)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        from .cpu_ext import cpu_extension  # the CPU kernels' extension, built on first use

        ext = cpu_extension()
        if ext is not None and hasattr(ext, "nf4_quantize"):
            packed = torch.empty(x.numel() // 2, dtype=torch.uint8)
            absmax = torch.empty(x.numel() // NF4_BLOCK, dtype=torch.float32)
            ext.nf4_quantize(x.contiguous().view(-1), nf4_bounds(), packed, absmax)
            return packed, absmax
    return nf4_quantize_ref(x)
