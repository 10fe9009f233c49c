"""8-bit codecs for offloaded activations (COAT-style, opt-in: ``activations_compress``).

COAT (Xi et al. 2024) keeps saved activations in FP8 with one scale per group of
elements. Here a floating-point saved tensor leaving for the HOST or NVME tier is
cut into blocks of ``COMPRESS_BLOCK`` (256) consecutive elements; each block keeps
its absolute maximum as an fp32 scale and each element becomes one byte:

- ``int8``: ``round(x * 127 / absmax)`` (symmetric, round to nearest even);
  ``|x - x'| <= absmax / 254`` per block.
- ``fp8``: ``x * 448 / absmax`` cast to ``float8_e4m3fn`` (3 mantissa bits, round to
  nearest); ``|x - x'| <= |x| / 16`` for normal values, ``absmax / 448 * 2**-10`` below.

The stored form of ``n`` elements is the codes (``n`` bytes) then the scales
(``4 * ceil(n / 256)`` bytes), each padded to 64 bytes: ``(256 + 4) / 512`` of a bf16
tensor's bytes, ``(256 + 4) / 1024`` of an fp32 one. Dequantized values are cast
back to the tensor's dtype.

Why not ``kernels/quantize.py``'s blockwise op: its dynamic quantile map is shaped for
Adam's moments (most codes near zero) and its CPU reference binary-searches 255
thresholds per element (~20x slower than these two vector ops on this machine, seconds
per step for SmolLM2); a linear grid over the block's range is what activations want.
Both codecs are plain torch ops, so they run where the tensor is (CUDA: on the device,
before the copy to the host, which then moves the 8-bit bytes).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from ..kernels.quantize import absmax_reciprocal, blocks_view, num_blocks
from .policy import ACTIVATION_COMPRESSION, COMPRESS_BLOCK

ALIGN = 64  # codes and scales start at 64-byte offsets (the pack's alignment; fp32 views need 4)
# Elements encoded or decoded at a time: the fp32 temporaries stay ~4 MiB each instead of a
# few times the tensor (they would add to the step's memory peak); a whole number of blocks.
CHUNK = 1 << 20
COMPRESSIBLE = (torch.float32, torch.bfloat16, torch.float16)  # dtypes a codec takes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Codec:
    """One 8-bit activation format: ``encode`` into bytes, ``decode`` back.

    Args:
        name: ``int8`` or ``fp8``.
    """

    def __init__(self, name: str):
        if name not in ACTIVATION_COMPRESSION or name == "none":
            raise ConfigError(f"activation codec {name!r} is not one of: "
                              f"{', '.join(c for c in ACTIVATION_COMPRESSION if c != 'none')}")
        self.name = name
        # the largest code: int8's 127, float8_e4m3fn's largest finite 448
        self._qmax = 127.0 if name == "int8" else float(torch.finfo(torch.float8_e4m3fn).max)
        self._code_dtype = torch.int8 if name == "int8" else torch.float8_e4m3fn

    def stored_bytes(self, numel: int) -> int:
        """Bytes of the stored form of ``numel`` elements (codes, then scales, each 64-aligned)."""
        return _aligned(numel) + _aligned(4 * num_blocks(numel, COMPRESS_BLOCK))

    def encode(self, x: Tensor, out: Tensor) -> None:
        """Write the stored form of ``x`` into ``out``.

        Args:
            x: 1-D floating-point tensor (a dtype of :data:`COMPRESSIBLE`).
            out: uint8 ``[stored_bytes(x.numel())]`` on ``x``'s device, 64-byte aligned.
        """
        n = x.numel()
        scales = out[_aligned(n):_aligned(n) + 4 * num_blocks(n, COMPRESS_BLOCK)].view(torch.float32)
        for i in range(0, n, CHUNK):
            part = x[i:i + CHUNK]
            blocks = blocks_view(part.float(), COMPRESS_BLOCK)
            scale = blocks.abs().amax(dim=1).div_(self._qmax)
            y = blocks.mul(absmax_reciprocal(scale)[:, None])  # in [-qmax, qmax]; all-zero blocks stay 0
            if self.name == "int8":
                y = y.round_()
            out[i:i + part.numel()].copy_(y.to(self._code_dtype).view(torch.uint8).reshape(-1)[:part.numel()])
            scales[i // COMPRESS_BLOCK:i // COMPRESS_BLOCK + scale.numel()].copy_(scale)

    def decode(self, stored: Tensor, out: Tensor) -> None:
        """Write the values :meth:`encode` stored in ``stored`` into ``out``.

        Args:
            stored: uint8 ``[>= stored_bytes(out.numel())]`` (HOST or device).
            out: 1-D tensor of the original dtype and length, on ``stored``'s device.
        """
        n = out.numel()
        scales = stored[_aligned(n):_aligned(n) + 4 * num_blocks(n, COMPRESS_BLOCK)].view(torch.float32)
        for i in range(0, n, CHUNK):
            m = min(CHUNK, n - i)
            vals = blocks_view(stored[i:i + m].view(self._code_dtype).float(), COMPRESS_BLOCK)
            vals.mul_(scales[i // COMPRESS_BLOCK:i // COMPRESS_BLOCK + vals.shape[0], None])
            out[i:i + m].copy_(vals.reshape(-1)[:m])  # rounds into the original dtype


def codec_for(compress: str) -> Codec | None:
    """The codec of an ``activations_compress`` name (None for ``none``).

    Raises:
        ConfigError: an unknown name.
    """
    if compress == "none":
        return None
    return Codec(compress)
