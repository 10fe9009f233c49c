"""Triton kernel for one chunk of the chunked linear + cross-entropy (CUDA impl).

The matmuls of ``linear_cross_entropy`` stay with cuBLAS (``torch.mm``); this
kernel fuses everything between them for one chunk of logits: an online
max / sum-exp pass (plus the row sum for label smoothing), the per-row loss,
and a second pass that overwrites the logits *in place* with their gradient
``scale * (softmax - (1 - eps) * onehot - eps / V)``. One program per row.

Import this module only where triton is installed (``linear_cross_entropy``
does so lazily, on CUDA). Tests run it on CPU tensors under ``TRITON_INTERPRET=1``,
which triton reads when ``@triton.jit`` runs, i.e. when this module is imported.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._library import next_power_of_2, pick_config

# CUDA: one row per program, a few thousand columns per tile. The interpreter's
# cost is per program and per loop step, so its default takes the largest tile.
_CUDA_CONFIGS = ({"BLOCK_V": 4096, "num_warps": 8},)
_INTERPRET_MAX_BLOCK = 1 << 16


@triton.jit
def _ce_chunk_kernel(logits_ptr, stride_row, targets_ptr, scale_ptr, scale_stride, loss_ptr,
                     V, ignore_index, eps, NEED_GRAD: tl.constexpr, SMOOTH: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    safe_t = tl.where(valid, target, 0)

    # Pass 1: online max and sum of exp over the row (and its plain sum for smoothing).
    row_max = tl.full((), float("-inf"), tl.float32)
    sum_exp = tl.zeros((), tl.float32)
    row_sum = tl.zeros((), tl.float32)
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max
        if SMOOTH:
            row_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = row_max + tl.log(sum_exp)
    z_t = tl.load(base + safe_t).to(tl.float32)
    loss = lse - (1.0 - eps) * z_t
    if SMOOTH:
        loss -= (eps / V) * row_sum
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))

    # Pass 2: overwrite the logits with d loss / d logits (0 on ignored rows).
    if NEED_GRAD:
        scale = tl.load(scale_ptr + row * scale_stride)
        scale = tl.where(valid, scale, 0.0)
        for off in range(0, V, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(cols == safe_t, g - (1.0 - eps), g)
            if SMOOTH:
                g -= eps / V
            tl.store(base + cols, g * scale, mask=mask)


def ce_chunk_triton(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                    ignore_index: int, label_smoothing: float, need_grad: bool) -> torch.Tensor:
    """Triton twin of ``linear_cross_entropy.ce_chunk_reference`` (same contract).

    Args:
        logits: [c, V] fp32 with unit column stride; overwritten with the gradient
            when ``need_grad``.
        targets: [c] int64.
        scale: [c] fp32 (any row stride, 0 included).
        ignore_index: target value of ignored rows.
        label_smoothing: eps in [0, 1].
        need_grad: whether to write the gradient into ``logits``.

    Returns:
        [c] fp32 per-row loss (0 on ignored rows).
    """
    c, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"logits stride {logits.stride()} needs a unit column stride")
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c == 0:
        return loss
    targets = targets.contiguous()
    cfg = pick_config(_CUDA_CONFIGS,
                      {"BLOCK_V": min(next_power_of_2(vocab), _INTERPRET_MAX_BLOCK), "num_warps": 4})
    _ce_chunk_kernel[(c,)](logits, logits.stride(0), targets, scale, scale.stride(0), loss,
                           vocab, ignore_index, float(label_smoothing),
                           NEED_GRAD=bool(need_grad), SMOOTH=label_smoothing > 0.0,
                           BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"])
    return loss
