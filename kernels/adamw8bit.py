"""The fused 8-bit AdamW update: ``outcore::adamw8bit_update``.

One call updates one parameter tensor in place together with its block-wise 8-bit
moments (256-element blocks, fp32 absmax per block), in one of two state formats
(:data:`STATE_FORMATS`): ``"dynamic"``, ``kernels/quantize.py``'s signed dynamic map for ``m``
and unsigned one for ``v``; ``"fp8"``, ``kernels/quantize_fp8.py``'s E4M3 for ``m`` and E5M2
for ``v``::

    m  = deq(m) * b1 + g * (1 - b1)
    v  = deq(v) * b2 + (g * g) * (1 - b2)
    p  = p * (1 - lr * wd) - (m / (sqrt(v) * (1 / sqrt(1 - b2^t)) + eps)) * (lr / (1 - b1^t))
    m, v = quantize(m), quantize(v)          # new absmax per block

That is torch's AdamW (decoupled weight decay applied before the step) written with one
rounding per operation; the scalar coefficients are computed in Python (double) and
rounded to fp32, as PyTorch does for Python scalars. The param step uses the fresh fp32
moments, before they are requantized (as bitsandbytes does).

Implementations (the tests check each claim), all bit-identical to the reference for finite
inputs:

* :func:`adamw8bit_update_ref` — pure PyTorch; defines the numerics.
* a C++ extension (``kernels/csrc/adamw8bit_cpu.cpp``), built on first use per ISA level
  (``kernels/cpu_ext.py``: AVX512_VBMI, AVX512, AVX2 or DEFAULT; ``OUTCORE_CPU_ISA`` picks a
  lower level). Blocks are
  handed to threads dynamically, and :func:`adamw8bit_update_many` updates all tensors of
  an optimizer step in one call. The fastest CPU path; ``OUTCORE_NO_CPP_EXT=1`` disables
  it and the reference serves.

  - Every level computes the reference's operations in its order, one rounding each (no
    FMA in the update). Dequantization is an exact table lookup (AVX-512: byte or fp32
    permutes in registers; AVX2: scalar loads and stores one block ahead, off the vector
    pipes; scalar: the map). Quantization: the scalar
    path uses the 7 KiB bucket table of ``kernels/quantize.py``; the vector paths a
    piecewise-linear quantizer (``kernels/adamw8bit_segments.py``: tables verified
    exhaustively) that hands the rare values next to a code boundary (~1e-4) to the bucket
    table, so its codes are the reference's.
  - Deterministic: the same bits for any thread count, per tensor or batched, so out-of-core
    runs equal in-memory runs bit for bit (both call this kernel), and at every ISA level.
  - bf16-lean (``optim/lean.py``; :func:`adamw8bit_update_many` with ``lean``): bf16 weights and
    gradients widened block by block into L1 buffers, updated, and the weights rounded back
    stochastically (``kernels/csrc/stochastic_round_cpu.h``): the bits of widening, updating
    and rounding as three steps, in one pass over memory.
* ``torch.compile`` of the reference (``impl="compile"``, for comparison in benchmarks).
* Triton for CUDA (``kernels/adamw8bit_triton.py``), both state formats: one fused kernel (the
  reference's torch ops where triton is not installed).

The reference's fp32 sqrt is made correctly rounded (numpy's, the hardware instruction)
because ``torch.sqrt`` on CPU is not (1 ulp off for ~20% of inputs here); every other op is
IEEE-exact in both PyTorch and C++.

Cost per element, one thread, 64K elements in cache, on the 2-core shared dev box (AMD EPYC
Zen 4, 2026-11-26; a stand-alone build of the kernel, ``OUTCORE_KERNEL_ONLY``; noisy):
this kernel 0.83 ns (AVX512_VBMI), 1.17 (AVX512 without VBMI), 1.10 (AVX2), 6.3 (DEFAULT);
from DRAM (16M elements) 0.87 (AVX512_VBMI) and 1.25 (AVX2) against torch's fused fp32 AdamW's
0.78-0.86 (either ISA). The divider (sqrt and divide, ~0.28 ns) is common to both updates; the
rest is the 8-bit work: quantization ~40%, dequantization (AVX2: scalar loads) ~25%. With the
AVX2 lookups moved off the vector pipes (2026-11-27, ``scripts/bench_adamw8bit_cpu.py``, AVX2
forced on that AVX-512 machine, load 2-8): AVX2 1.00-1.02 ns against 1.11 before, in cache;
what is left is vector-op bound (the two requantizations ~0.55 ns, the divider hidden under
them). On an AMD EPYC Zen 5 (2026-11-27, one thread): AVX2 0.72-0.83 ns per element, AVX-512 VBMI
0.41-0.50 (in cache - DRAM); the bf16-lean pass 0.96 / 0.51-0.55 (``--lean``). With one byte
load per map lookup and lean's rounding in the second requantization loop (2026-11-27, Zen 5,
AVX2): 0.76-0.77 / 0.81 and lean 0.92-0.96 / 0.96. There the AVX2 update runs ~124
instructions per 8 elements at ~5.2 per cycle (48 of them the lookups, ~55 vector ALU
operations), against torch's fused AdamW's ~16 cycles per 8 elements on a core.
The FP8 format's update (2026-12-02, Zen 4, ``bench_adamw8bit_cpu.py --formats dynamic,fp8``,
whose driver reads the step's coefficients at run time): with AVX2 forced ~62 instructions per
8 elements instead of ~124, 0.71 ns per element in cache and 0.82 from DRAM; with AVX-512's 16
lanes 0.60 and 0.73. Torch's fused AdamW took 0.46-0.53 and 0.98 in an earlier run that day.
``scripts/bench_optim.py`` measures whole optimizer steps per ISA level (``--isa``).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._library import op_name, triton_usable
from .adamw8bit_segments import segment_tables
from .cpu_ext import cpu_extension
from .quantize import (BLOCKSIZE, blocks_view, bucket_table, dynamic_map, num_blocks,
                       quantize_blocks_ref, thresholds)
from .quantize_fp8 import fp8_dequantize_blocks, fp8_quantize_blocks

IMPLS = ("auto", "ref", "cpp", "compile")
# How the moments' codes are read: bitsandbytes' dynamic maps (kernels/quantize.py) or FP8
# (kernels/quantize_fp8.py); the index is the C++ extension's Format.
STATE_FORMATS = ("dynamic", "fp8")
# FP8 by default: its CPU update is ~1.4x the dynamic maps' with AVX2 (no table lookups), and its
# training losses were as close to fp32 AdamW's as the dynamic maps' or closer in every run of
# scripts/bench_adamw8bit_convergence.py (docs/benchmarks.md). "dynamic" stays for bitsandbytes'
# codes and for states saved before FP8 existed.
DEFAULT_STATE_FORMAT = "fp8"


def check_state_format(state_format: str) -> None:
    """Raises ValueError unless ``state_format`` is one of :data:`STATE_FORMATS`."""
    if state_format not in STATE_FORMATS:
        raise ValueError(f"state_format={state_format!r} is not one of {STATE_FORMATS}")


class Coefficients(NamedTuple):
    """The scalars of one 8-bit AdamW step (Python floats; fp32-rounded where used)."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    inv_bc2_sqrt: float  # 1 / sqrt(1 - beta2 ** step)
    eps: float
    step_size: float  # lr / (1 - beta1 ** step)
    decay: float  # 1 - lr * weight_decay


def coefficients(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: float) -> Coefficients:
    """The scalar coefficients of step number ``step`` (1-based).

    Raises:
        ValueError: ``step`` < 1.
    """
    if step < 1:
        raise ValueError(f"step={step} must be >= 1 (the count after this update)")
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return Coefficients(beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 / math.sqrt(bc2), eps,
                        lr / bc1, 1.0 - lr * weight_decay)


@functools.lru_cache(maxsize=None)
def _zero_code(signed: bool, state_format: str = DEFAULT_STATE_FORMAT) -> int:
    if state_format == "fp8":
        return 0  # +0.0 in both FP8 formats
    return int((dynamic_map(signed) == 0).nonzero()[0, 0])


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device) -> tuple[Tensor, ...]:
    """(qmap_m, qmap_v, bucket_m, thr_m, bucket_v, thr_v) on ``device``, built once.

    The bucket tables get 4 bytes of padding (room for a 4-byte gather; the C++ kernel
    checks that size).
    """
    qm, qv = dynamic_map(True, device), dynamic_map(False, device)
    pad = torch.zeros(4, dtype=torch.uint8, device=device)
    return (qm, qv, torch.cat([bucket_table(True, device), pad]), thresholds(qm),
            torch.cat([bucket_table(False, device), pad]), thresholds(qv))


def init_codes(numel: int, signed: bool, device: torch.device | str = "cpu",
               state_format: str = DEFAULT_STATE_FORMAT) -> Tensor:
    """Codes of an all-zero moment: (numel,) uint8 filled with the format's code of 0."""
    check_state_format(state_format)
    return torch.full((numel,), _zero_code(signed, state_format), dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------
def adamw8bit_update_ref(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                         v_codes: Tensor, v_absmax: Tensor, c: Coefficients,
                         state_format: str = DEFAULT_STATE_FORMAT) -> None:
    """Reference 8-bit AdamW update, in place (see the module docstring).

    Args:
        param: (n,) float32, contiguous.    grad: (n,) float32.
        m_codes, v_codes: (n,) uint8.       m_absmax, v_absmax: (ceil(n/256),) float32.
        c: the step's :class:`Coefficients`.
        state_format: one of :data:`STATE_FORMATS`: what the codes mean.
    """
    n = param.numel()
    g = blocks_view(grad.reshape(-1))
    p = blocks_view(param.reshape(-1))
    # Padding codes dequantize to 0, so a partial last block's absmax sees only real values.
    mp, vp = _pad_codes(m_codes, True, state_format), _pad_codes(v_codes, False, state_format)
    if state_format == "fp8":
        m, v = fp8_dequantize_blocks(mp, m_absmax, True), fp8_dequantize_blocks(vp, v_absmax, False)
        p, m, v = adamw_step_ref(p, g, m, v, c)
        (mc, ma), (vc, va) = fp8_quantize_blocks(m, True), fp8_quantize_blocks(v, False)
    else:
        qm, qv = _tables(param.device)[:2]
        m, v = qm[mp.long()] * m_absmax[:, None], qv[vp.long()] * v_absmax[:, None]
        p, m, v = adamw_step_ref(p, g, m, v, c)
        (mc, ma), (vc, va) = quantize_blocks_ref(m, qm), quantize_blocks_ref(v, qv)
    param.view(-1).copy_(p.view(-1)[:n])
    m_codes.view(-1).copy_(mc.view(-1)[:n])
    v_codes.view(-1).copy_(vc.view(-1)[:n])
    m_absmax.copy_(ma)
    v_absmax.copy_(va)


def adamw_step_ref(p: Tensor, g: Tensor, m: Tensor, v: Tensor, c: Coefficients
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """One AdamW step in the references' op order, one rounding per operation (the sqrt the
    IEEE one): the new ``(p, m, v)``, nothing in place. The CPU kernels (this 8-bit update,
    ``kernels/frugal.py``'s) compute exactly these operations."""
    m = m * c.beta1 + g * c.one_minus_beta1
    v = v * c.beta2 + (g * g) * c.one_minus_beta2
    denom = _ieee_sqrt(v) * c.inv_bc2_sqrt + c.eps
    return p * c.decay - (m / denom) * c.step_size, m, v


def _ieee_sqrt(x: Tensor) -> Tensor:
    """Correctly rounded fp32 sqrt. torch.sqrt on CPU is not (it is off by one ulp for ~20%
    of inputs here: a vector-math library), numpy's is (the hardware instruction); numpy has
    no bf16 / fp16, which keep torch's."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and not torch.compiler.is_compiling()):
        import numpy as np
        return torch.from_numpy(np.sqrt(x.detach().contiguous().numpy()))
    return x.sqrt()  # CUDA's and Inductor's fp32 sqrt are the IEEE one


def _pad_codes(codes: Tensor, signed: bool, state_format: str) -> Tensor:
    flat = codes.reshape(-1)
    pad = num_blocks(flat.numel()) * BLOCKSIZE - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), _zero_code(signed, state_format))])
    return flat.view(-1, BLOCKSIZE)


@functools.lru_cache(maxsize=1)
def _compiled_ref():
    return torch.compile(adamw8bit_update_ref, dynamic=True)


@functools.lru_cache(maxsize=1)
def _cpu_tables() -> tuple[Tensor, ...]:
    return (*_tables(torch.device("cpu")), segment_tables(True), segment_tables(False))


def quantize_blockwise_cpp(x: Tensor, signed: bool, isa: str | None = None) -> tuple[Tensor, Tensor]:
    """Block-wise quantization through the C++ update's requantization path (for tests).

    Args:
        x: (n,) float32 CPU tensor; ``>= 0`` when ``signed`` is False.
        signed: which dynamic map.
        isa: build level (default ``kernels/cpu_ext.py: cpu_isa``).

    Returns:
        codes (n,) uint8 and absmax (ceil(n / 256),) float32, as ``quantize_blockwise``.

    Raises:
        ValueError: the extension cannot be built here.
    """
    ext = cpu_extension(isa)
    if ext is None:
        raise ValueError("the C++ extension is disabled or cannot be built here")
    tab = _cpu_tables()
    bucket, thr, seg = (tab[2], tab[3], tab[6]) if signed else (tab[4], tab[5], tab[7])
    return ext.quantize_blockwise(x.contiguous().view(-1), bool(signed), bucket, thr, seg)


def fp8_quantize_blockwise_cpp(x: Tensor, signed: bool, isa: str | None = None) -> tuple[Tensor, Tensor]:
    """Block-wise FP8 quantization through the C++ update's encoding (for tests): codes (n,)
    uint8 and absmax (ceil(n / 256),) float32, as ``kernels/quantize_fp8.py`` defines them.

    Raises:
        ValueError: the extension cannot be built here.
    """
    ext = cpu_extension(isa)
    if ext is None:
        raise ValueError("the C++ extension is disabled or cannot be built here")
    return ext.fp8_quantize_blockwise(x.contiguous().view(-1), bool(signed))


def _update_cpp(ext, param, grad, m_codes, m_absmax, v_codes, v_absmax, c: Coefficients,
                state_format: str) -> None:
    ext.adamw8bit_update(param, grad, m_codes, m_absmax, v_codes, v_absmax, list(_cpu_tables()),
                         list(c), STATE_FORMATS.index(state_format))


def adamw8bit_update_many(params: list[Tensor], grads: list[Tensor], m_codes: list[Tensor],
                          m_absmax: list[Tensor], v_codes: list[Tensor], v_absmax: list[Tensor],
                          coeffs: list[Coefficients],
                          lean: list[tuple[int, int]] | None = None,
                          state_format: str = DEFAULT_STATE_FORMAT) -> bool:
    """Update many CPU tensors in one C++ call (one parallel region for all their blocks).

    The optimizer's fast path: no per-tensor Python dispatch or thread fork/join. Same
    numerics as :func:`adamw8bit_update` per tensor. Tensors must be contiguous (any shape:
    the kernel reads their numel and data); the C++ side checks dtypes, sizes and contiguity
    (RuntimeError).

    Args:
        params, grads: float32 CPU tensors of n_i elements each (contiguous, any shape);
            bfloat16 with ``lean``.
        m_codes, v_codes: (n_i,) uint8.    m_absmax, v_absmax: (ceil(n_i / 256),) float32.
        coeffs: each tensor's :class:`Coefficients` (its own step count).
        lean: bf16-lean (``optim/lean.py``): per tensor, the ``(key, offset)`` of
            :func:`~outcore.kernels.stochastic_round.stochastic_round_`. Each tensor is updated
            as its weights and gradients widened to fp32, then rounded back stochastically with
            that key, its first element at index ``offset``: the same bits as those three steps
            done apart, in one pass.
        state_format: one of :data:`STATE_FORMATS`, for all the tensors.

    Returns:
        False (nothing done) where the extension is disabled or cannot be built: the caller
        then updates tensor by tensor.
    """
    check_state_format(state_format)
    ext = cpu_extension()
    if ext is None:
        return False
    flat = [float(x) for c in coeffs for x in c]
    ext.adamw8bit_update_many(params, grads, m_codes, m_absmax, v_codes, v_absmax,
                              list(_cpu_tables()), flat, [int(x) for kv in lean or () for x in kv],
                              STATE_FORMATS.index(state_format))
    return True


# ---------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------
@torch.library.custom_op(op_name("adamw8bit_update"),
                         mutates_args=("param", "m_codes", "m_absmax", "v_codes", "v_absmax"))
def adamw8bit_update_op(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                        v_codes: Tensor, v_absmax: Tensor, lr: float, beta1: float, beta2: float,
                        eps: float, weight_decay: float, step: float, state_format: str) -> None:
    """Op form of :func:`adamw8bit_update` (CPU: the C++ extension if built, else the reference)."""
    c = coefficients(lr, beta1, beta2, eps, weight_decay, step)
    ext = cpu_extension() if param.device.type == "cpu" else None
    if ext is not None:
        _update_cpp(ext, param, grad, m_codes, m_absmax, v_codes, v_absmax, c, state_format)
    else:
        adamw8bit_update_ref(param, grad, m_codes, m_absmax, v_codes, v_absmax, c, state_format)


@adamw8bit_update_op.register_fake
def _(param, grad, m_codes, m_absmax, v_codes, v_absmax, lr, beta1, beta2, eps, weight_decay, step,
      state_format):
    return None


@adamw8bit_update_op.register_kernel("cuda")
def _(param, grad, m_codes, m_absmax, v_codes, v_absmax, lr, beta1, beta2, eps, weight_decay, step,
      state_format):
    c = coefficients(lr, beta1, beta2, eps, weight_decay, step)
    # one fused Triton kernel for either format; without triton the reference's torch ops
    if triton_usable(param):
        from .adamw8bit_triton import adamw8bit_update_triton
        adamw8bit_update_triton(param, grad, m_codes, m_absmax, v_codes, v_absmax, c, state_format)
    else:
        adamw8bit_update_ref(param, grad, m_codes, m_absmax, v_codes, v_absmax, c, state_format)


def adamw8bit_update(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                     v_codes: Tensor, v_absmax: Tensor, *, lr: float, beta1: float, beta2: float,
                     eps: float, weight_decay: float, step: float, impl: str = "auto",
                     state_format: str = DEFAULT_STATE_FORMAT) -> None:
    """One 8-bit AdamW step of one tensor, in place.

    Args:
        param: any shape, float32, contiguous (updated in place).
        grad: same numel as ``param``, float32.
        m_codes, v_codes: (numel,) uint8 moment codes (see :func:`init_codes`).
        m_absmax, v_absmax: (ceil(numel / 256),) float32 block absmax.
        lr, beta1, beta2, eps, weight_decay: AdamW hyper-parameters.
        step: the step count *after* this update (1 for the first step).
        impl: "auto" (the op: C++ on CPU when built, Triton on CUDA), "ref", "cpp"
            (raises if the extension cannot be built) or "compile".
        state_format: one of :data:`STATE_FORMATS`: what the codes mean.

    Raises:
        ValueError: bad dtypes, sizes, devices, ``impl`` or ``state_format``.
    """
    check_state_format(state_format)
    _validate(param, grad, m_codes, m_absmax, v_codes, v_absmax)
    grad = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().reshape(-1)
    p = param.view(-1)
    if impl == "auto":
        adamw8bit_update_op(p, grad, m_codes, m_absmax, v_codes, v_absmax, float(lr), float(beta1),
                            float(beta2), float(eps), float(weight_decay), float(step), state_format)
        return
    c = coefficients(lr, beta1, beta2, eps, weight_decay, step)
    if impl == "ref":
        adamw8bit_update_ref(p, grad, m_codes, m_absmax, v_codes, v_absmax, c, state_format)
    elif impl == "compile":
        _compiled_ref()(p, grad, m_codes, m_absmax, v_codes, v_absmax, c, state_format)
    elif impl == "cpp":
        ext = cpu_extension()
        if ext is None or param.device.type != "cpu":
            raise ValueError("impl='cpp' needs CPU tensors and a buildable C++ extension "
                             "(unset OUTCORE_NO_CPP_EXT, install a C++ compiler)")
        _update_cpp(ext, p, grad, m_codes, m_absmax, v_codes, v_absmax, c, state_format)
    else:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")


def _validate(param, grad, m_codes, m_absmax, v_codes, v_absmax) -> None:
    n = param.numel()
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"param must be a contiguous float32 tensor, got {param.dtype} "
                         f"(contiguous={param.is_contiguous()})")
    if grad.dtype != torch.float32 or grad.numel() != n:
        raise ValueError(f"grad must be float32 with {n} elements, got {grad.dtype} with {grad.numel()}")
    for name, t, dtype, size in (("m_codes", m_codes, torch.uint8, n), ("v_codes", v_codes, torch.uint8, n),
                                 ("m_absmax", m_absmax, torch.float32, num_blocks(n)),
                                 ("v_absmax", v_absmax, torch.float32, num_blocks(n))):
        if t.dtype != dtype or t.numel() != size or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of {size} elements, "
                             f"got {t.dtype} with {t.numel()}")
        if t.device != param.device:
            raise ValueError(f"{name} is on {t.device} but param is on {param.device}")
