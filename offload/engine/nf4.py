"""A unit's frozen weights stored in 4-bit NormalFloat (QLoRA's NF4), decoded on fetch.

QLoRA keeps the frozen base in NF4 (blocks of 64 weights, one fp32 absmax each:
0.5625 bytes per weight instead of 4) and computes with its dequantized values.
Out of core that is what moves: a unit's NF4 bytes stream from their tier, and the
unit is dequantized into its compute dtype when it is fetched. The (de)quantization
is bitsandbytes' (its ``dequantize_4bit``; the quantizer is ``kernels/nf4.py``'s, whose C++
kernel gives bitsandbytes' bits 20-60x faster: a 70B base quantizes in minutes): the numbers
are exactly those of a bitsandbytes NF4 layer.

Why not bitsandbytes' ``Linear4bit`` modules themselves: their autograd function
keeps the packed weight in ``ctx`` directly, outside ``saved_tensors_hooks``, so a
weight released after the forward would be read back from reused memory in the
backward. Dequantizing into plain ``nn.Linear`` weights keeps every saved weight
visible to the engine.

Layout of a quantized unit's byte buffer: for each of its parameters in order, either
``[packed 4-bit codes | fp32 absmax]`` (frozen matrices) or the raw bytes in the
compute dtype (norms, vectors), each piece 64-byte aligned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.nf4 import NF4_BLOCK as BLOCK  # weights per absmax (QLoRA's block size)
from ...kernels.nf4 import nf4_quantize
from .units import PARAM_ALIGN, Unit

#: weights dequantized per call (whole rows; every row is whole NF4 blocks). bitsandbytes returns a
#: new tensor per call: at 128K weights (at most 512 KiB) it stays under the mmap threshold
#: (``aligned.MMAP_THRESHOLD``) and reuses the same heap memory call after call, where 4M-weight
#: slices were fresh mappings, page-faulted on every call (a 70B MLP matrix: 0.14 s against 0.75 s)
DECODE_CHUNK = 1 << 17


def _align(n: int) -> int:
    return (n + PARAM_ALIGN - 1) // PARAM_ALIGN * PARAM_ALIGN


def quantizable(unit: Unit, k: int) -> bool:
    """Is the ``k``-th parameter of ``unit`` stored in NF4? Frozen matrices of the transformer
    blocks are (QLoRA keeps embeddings, the head and vectors in 16/32 bits)."""
    slot = unit.slots[k]
    return (unit.name.startswith("block.") and not slot.param.requires_grad
            and len(slot.shape) == 2 and slot.numel % BLOCK == 0)


@dataclass(frozen=True)
class _Piece:
    slot: int  # index into unit.slots
    offset: int  # bytes into the unit's buffer
    nbytes: int  # packed codes (quantized) or raw bytes
    quantized: bool


class NF4Layout:
    """Where each parameter of one unit lies in its NF4 byte buffer, and the codec.

    Args:
        unit: the unit (its slots give shapes and the compute dtype).
        dtype: the compute dtype the unit is dequantized into.
    """

    def __init__(self, unit: Unit, dtype: torch.dtype):
        self.unit, self.dtype = unit, dtype
        self.pieces: list[_Piece] = []
        offset = 0
        for k, slot in enumerate(unit.slots):
            q = quantizable(unit, k)
            n = slot.numel // 2 if q else slot.numel * dtype.itemsize
            self.pieces.append(_Piece(k, offset, n, q))
            offset += _align(n) + (_align(slot.numel // BLOCK * 4) if q else 0)
        self.nbytes = max(offset, 1)

    @staticmethod
    def any_quantized(unit: Unit) -> bool:
        return any(quantizable(unit, k) for k in range(len(unit.slots)))

    def encode(self, k: int, value: torch.Tensor, out: torch.Tensor) -> None:
        """Store parameter ``k``'s ``value`` [shape] (any float dtype) into ``out`` [nbytes] (uint8)."""
        p = self.pieces[k]
        if not p.quantized:
            out[p.offset:p.offset + p.nbytes].view(self.dtype).copy_(value.reshape(-1))
            return
        packed, scales = nf4_quantize(value.detach())
        out[p.offset:p.offset + p.nbytes].copy_(packed)
        absmax = out[p.offset + _align(p.nbytes):][:scales.numel() * 4].view(torch.float32)
        absmax.copy_(scales)

    def decode(self, raw: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Dequantize the unit's bytes ``raw`` [nbytes] (uint8) into ``flat`` [unit.numel] (compute dtype)."""
        import bitsandbytes.functional as F

        for p in self.pieces:
            slot = self.unit.slots[p.slot]
            dest = self.unit.view(flat, slot)
            src = raw[p.offset:p.offset + p.nbytes]
            if not p.quantized:
                dest.copy_(src.view(self.dtype).view(slot.shape))
                continue
            absmax = raw[p.offset + _align(p.nbytes):][:slot.numel // BLOCK * 4].view(torch.float32)
            # a few rows at a time (rows of whole NF4 blocks): a 70B block's MLP matrix whole
            # would be a 470 MB temporary beside the unit
            rows, cols = dest.reshape(-1, slot.shape[-1]).shape
            step = max(1, DECODE_CHUNK // cols) if cols % BLOCK == 0 else rows
            for r in range(0, rows, step):
                m = min(rows, r + step) - r
                state = F.QuantState(absmax=absmax[r * cols // BLOCK:][:m * cols // BLOCK],
                                     shape=torch.Size((m, cols)), code=_nf4_code(), blocksize=BLOCK,
                                     quant_type="nf4", dtype=self.dtype)
                dest.view(rows, cols)[r:r + m].copy_(F.dequantize_4bit(src[r * cols // 2:][:m * cols // 2].view(-1, 1),
                                                                         state))
        return flat


_CODE: list[torch.Tensor] = []


def _nf4_code() -> torch.Tensor:
    """bitsandbytes' NF4 code book (the 16 NormalFloat levels)."""
    if not _CODE:
        import bitsandbytes.functional as F
        _CODE.append(F.get_4bit_type("nf4", device="cpu"))
    return _CODE[0]


def nf4_round_trip(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` [rows, cols] as the engine computes with it after NF4 storage (for references/tests)."""
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(value.detach().float().contiguous(), blocksize=BLOCK, quant_type="nf4")
    state.dtype = dtype
    return F.dequantize_4bit(packed, state)
