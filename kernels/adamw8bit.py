"""The fused 8-bit AdamW update: ``outcore::adamw8bit_update``.

One call updates one parameter tensor in place together with its block-wise 8-bit
moments (``kernels/quantize.py``: signed dynamic map for ``m``, unsigned for ``v``,
256-element blocks, fp32 absmax per block)::

    m  = deq(m) * b1 + g * (1 - b1)
    v  = deq(v) * b2 + (g * g) * (1 - b2)
    p  = p * (1 - lr * wd) - (m / (sqrt(v) * (1 / sqrt(1 - b2^t)) + eps)) * (lr / (1 - b1^t))
    m, v = quantize(m), quantize(v)          # new absmax per block

That is torch's AdamW (decoupled weight decay applied before the step) written with one
rounding per operation; the scalar coefficients are computed in Python (double) and
rounded to fp32, as PyTorch does for Python scalars. The param step uses the fresh fp32
moments, before they are requantized (as bitsandbytes does).

Implementations, all bit-identical (the tests check it):

* :func:`adamw8bit_update_ref` — pure PyTorch; defines the numerics.
* a C++ extension (``kernels/csrc/adamw8bit_cpu.cpp``), built on first use with
  ``torch.utils.cpp_extension.load`` and cached in ``TORCH_EXTENSIONS_DIR``: ``-O3
  -ffp-contract=off`` plus the ISA flags of the CPU it runs on (AVX-512 / AVX2 /
  none, chosen at run time by ``torch.backends.cpu.get_cpu_capability()``; each has its
  own cache entry, so a cache copied to an older CPU is never loaded there). On AVX-512
  every table lookup is an in-register permute (gathers ran at ~1 element/cycle and were
  the bottleneck) and quantization is a branch-free binary search; elsewhere a scalar
  loop with the 7 KiB bucket table of ``kernels/quantize.py``. The fastest CPU path;
  ``OUTCORE_NO_CPP_EXT=1`` disables it and the reference serves.
* ``torch.compile`` of the reference (``impl="compile"``, for comparison in benchmarks).
* Triton for CUDA (``kernels/adamw8bit_triton.py``).

Exactness, not a tolerance: the reference's fp32 sqrt is made correctly rounded (numpy's,
the hardware instruction) because ``torch.sqrt`` on CPU is not (1 ulp off for ~20% of
inputs here); every other op is IEEE-exact in both PyTorch and C++.

Measured on the 2-core shared dev box (noisy; side by side in one run, CPU time per
element, 1 thread, 1M elements): the gather-based AVX-512 C++ 1.9 ns/elem, the
permute-based 1.7 ns/elem, of which ~1.2 ns is the two requantizations; torch fused fp32
AdamW 0.4-1.0 ns/elem. ``scripts/bench_optim.py --impls`` compares ref / compile / C++.
"""
from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from ._library import op_name, triton_usable
from .quantize import (BLOCKSIZE, blocks_view, bucket_table, dynamic_map, num_blocks,
                       quantize_blocks_ref, thresholds)

IMPLS = ("auto", "ref", "cpp", "compile")


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
def _zero_code(signed: bool) -> int:
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


def init_codes(numel: int, signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """Codes of an all-zero moment: (numel,) uint8 filled with the map's index of 0."""
    return torch.full((numel,), _zero_code(signed), dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------
def adamw8bit_update_ref(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                         v_codes: Tensor, v_absmax: Tensor, c: Coefficients) -> None:
    """Reference 8-bit AdamW update, in place (see the module docstring).

    Args:
        param: (n,) float32, contiguous.    grad: (n,) float32.
        m_codes, v_codes: (n,) uint8.       m_absmax, v_absmax: (ceil(n/256),) float32.
        c: the step's :class:`Coefficients`.
    """
    n = param.numel()
    qm, qv = _tables(param.device)[:2]
    g = blocks_view(grad.reshape(-1))
    p = blocks_view(param.reshape(-1))
    # Padding codes dequantize to 0, so a partial last block's absmax sees only real values.
    m = qm[_pad_codes(m_codes, True).long()] * m_absmax[:, None]
    v = qv[_pad_codes(v_codes, False).long()] * v_absmax[:, None]
    m = m * c.beta1 + g * c.one_minus_beta1
    v = v * c.beta2 + (g * g) * c.one_minus_beta2
    denom = _ieee_sqrt(v) * c.inv_bc2_sqrt + c.eps
    p = p * c.decay - (m / denom) * c.step_size
    mc, ma = quantize_blocks_ref(m, qm)
    vc, va = quantize_blocks_ref(v, qv)
    param.view(-1).copy_(p.view(-1)[:n])
    m_codes.view(-1).copy_(mc.view(-1)[:n])
    v_codes.view(-1).copy_(vc.view(-1)[:n])
    m_absmax.copy_(ma)
    v_absmax.copy_(va)


def _ieee_sqrt(x: Tensor) -> Tensor:
    """Correctly rounded fp32 sqrt. torch.sqrt on CPU is not (it is off by one ulp for ~20%
    of inputs here: a vector-math library), numpy's is (the hardware instruction)."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        import numpy as np
        return torch.from_numpy(np.sqrt(x.detach().contiguous().numpy()))
    return x.sqrt()  # CUDA's and Inductor's fp32 sqrt are the IEEE one


def _pad_codes(codes: Tensor, signed: bool) -> Tensor:
    flat = codes.reshape(-1)
    pad = num_blocks(flat.numel()) * BLOCKSIZE - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), _zero_code(signed))])
    return flat.view(-1, BLOCKSIZE)


@functools.lru_cache(maxsize=1)
def _compiled_ref():
    return torch.compile(adamw8bit_update_ref, dynamic=True)


# ---------------------------------------------------------------------------------
# C++ extension (built lazily, cached on disk)
# ---------------------------------------------------------------------------------
_EXT_LOCK = threading.Lock()
_EXT: list = []  # [module or None] once a build was attempted

_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def cpu_extension():
    """The compiled CPU extension, or None where it cannot be built or is disabled.

    The first call compiles ``kernels/csrc/adamw8bit_cpu.cpp`` (about 30-60 s on a 2-core
    machine, then cached in ``TORCH_EXTENSIONS_DIR``; later processes load it in < 1 s).
    A failed build warns once and returns None: callers fall back to the reference.
    """
    if os.environ.get("OUTCORE_NO_CPP_EXT", "0") == "1":
        return None
    with _EXT_LOCK:  # one build per process; cpp_extension itself locks across processes
        if not _EXT:
            _EXT.append(_build_extension())
        return _EXT[0]


def _build_extension():
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    isa = isa if isa in _ISA_FLAGS else "DEFAULT"
    src = Path(__file__).with_name("csrc") / "adamw8bit_cpu.cpp"
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", *_ISA_FLAGS.get(isa, [])]
    try:
        return cpp_extension.load(name=f"outcore_adamw8bit_cpu_{isa.lower()}", sources=[str(src)],
                                  extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers, ...: the reference still works
        warnings.warn(f"outcore: could not build the CPU 8-bit AdamW extension ({exc!r}); "
                      "using the slower pure-PyTorch reference", RuntimeWarning, stacklevel=3)
        return None


def _update_cpp(ext, param, grad, m_codes, m_absmax, v_codes, v_absmax, c: Coefficients) -> None:
    ext.adamw8bit_update(param, grad, m_codes, m_absmax, v_codes, v_absmax,
                         *_tables(param.device), *c)


# ---------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------
@torch.library.custom_op(op_name("adamw8bit_update"),
                         mutates_args=("param", "m_codes", "m_absmax", "v_codes", "v_absmax"))
def adamw8bit_update_op(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                        v_codes: Tensor, v_absmax: Tensor, lr: float, beta1: float, beta2: float,
                        eps: float, weight_decay: float, step: float) -> None:
    """Op form of :func:`adamw8bit_update` (CPU: the C++ extension if built, else the reference)."""
    c = coefficients(lr, beta1, beta2, eps, weight_decay, step)
    ext = cpu_extension() if param.device.type == "cpu" else None
    if ext is not None:
        _update_cpp(ext, param, grad, m_codes, m_absmax, v_codes, v_absmax, c)
    else:
        adamw8bit_update_ref(param, grad, m_codes, m_absmax, v_codes, v_absmax, c)


@adamw8bit_update_op.register_fake
def _(param, grad, m_codes, m_absmax, v_codes, v_absmax, lr, beta1, beta2, eps, weight_decay, step):
    return None


@adamw8bit_update_op.register_kernel("cuda")
def _(param, grad, m_codes, m_absmax, v_codes, v_absmax, lr, beta1, beta2, eps, weight_decay, step):
    c = coefficients(lr, beta1, beta2, eps, weight_decay, step)
    if triton_usable(param):
        from .adamw8bit_triton import adamw8bit_update_triton
        adamw8bit_update_triton(param, grad, m_codes, m_absmax, v_codes, v_absmax, c)
    else:  # pragma: no cover
        adamw8bit_update_ref(param, grad, m_codes, m_absmax, v_codes, v_absmax, c)


def adamw8bit_update(param: Tensor, grad: Tensor, m_codes: Tensor, m_absmax: Tensor,
                     v_codes: Tensor, v_absmax: Tensor, *, lr: float, beta1: float, beta2: float,
                     eps: float, weight_decay: float, step: float, impl: str = "auto") -> None:
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

    Raises:
        ValueError: bad dtypes, sizes, devices or ``impl``.
    """
    _validate(param, grad, m_codes, m_absmax, v_codes, v_absmax)
    grad = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().reshape(-1)
    p = param.view(-1)
    if impl == "auto":
        adamw8bit_update_op(p, grad, m_codes, m_absmax, v_codes, v_absmax, float(lr), float(beta1),
                            float(beta2), float(eps), float(weight_decay), float(step))
        return
    c = coefficients(lr, beta1, beta2, eps, weight_decay, step)
    if impl == "ref":
        adamw8bit_update_ref(p, grad, m_codes, m_absmax, v_codes, v_absmax, c)
    elif impl == "compile":
        _compiled_ref()(p, grad, m_codes, m_absmax, v_codes, v_absmax, c)
    elif impl == "cpp":
        ext = cpu_extension()
        if ext is None or param.device.type != "cpu":
            raise ValueError("impl='cpp' needs CPU tensors and a buildable C++ extension "
                             "(unset OUTCORE_NO_CPP_EXT, install a C++ compiler)")
        _update_cpp(ext, p, grad, m_codes, m_absmax, v_codes, v_absmax, c)
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
