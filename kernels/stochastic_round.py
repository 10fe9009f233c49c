"""Stochastic rounding fp32 -> bf16 with counter-based bits: ``outcore::stochastic_round_``.

``out[i] = SR(x[i])``: of the two bf16 values around ``x[i]`` take the one farther from zero
with probability (dropped low 16 bits) / 2^16, so ``E[SR(x)] == x`` exactly (the update of a
weight too small for one bf16 ulp still moves it on average: what round-to-nearest loses
when a run keeps no fp32 master, docs/architecture.md §5). On the bit pattern that is
``bits(x) + r`` truncated to its top 16 bits, ``r`` uniform in [0, 2^16): adding to a
sign-magnitude pattern grows the magnitude, and a carry moves into the exponent exactly when
the value crosses a binade (subnormals and the largest finite values round the same way;
an overflow gives inf, as round-to-nearest would). NaN stays NaN.

The random bits are not drawn from a generator stream: ``r`` for element ``i`` is a hash of
``(key, offset + i)`` (:func:`random_bits`), with ``key`` mixed from (run seed, parameter,
step) by :func:`round_key`. So updating a tensor whole or in pieces, in memory or out of
core, before or after a resume, rounds every element with the same bits.

Backends, bit-identical (all compute the hash in exact 32-bit integer arithmetic): the
pure-PyTorch reference (:func:`stochastic_round_ref_`, any device), the CPU C++ extension
(``kernels/csrc/stochastic_round_cpu.h``, where it builds; else the reference) and a Triton
kernel for CUDA (:mod:`outcore.kernels.stochastic_round_triton`; tested on CPU with
``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ._library import cuda_kernel_registrar
from .zo_perturb import zo_seed

_M32 = 0xFFFFFFFF
# A 32-bit integer hash from Chris Wellons' hash-prospector ("[15 2c1b3c6d 12 297a2d39 15]"):
# two xorshift-multiply rounds. Both multipliers are below 2^30, so a product of a 32-bit
# value stays below 2^62 and the reference computes it exactly in int64 (Triton in uint32).
HASH_MULS = (0x2C1B3C6D, 0x297A2D39)
HASH_SHIFTS = (15, 12, 15)
# Reference elements per pass: two int64 scratch buffers of 128 KiB (in cache), and under torch's
# parallel grain (32768), so no op opens a parallel region: on a busy 2-core machine their barrier
# waits cost ~100x the arithmetic.
_SUB = 1 << 14


def round_key(seed: int, index: int, step: int) -> int:
    """The 64-bit key of one tensor's rounding at one step.

    Args:
        seed: the run's seed (>= 0).
        index: the parameter's position among the trainable parameters (>= 0).
        step: the tensor's update count (>= 0).

    Returns:
        A key in ``[0, 2**63)``, a pure function of the three (splitmix64 mixing).

    Raises:
        ConfigError: a negative argument.
    """
    return zo_seed(zo_seed(seed, index), step)


def _hash32_(h: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Hash int64 values in [0, 2^32) in place (exact: see ``HASH_MULS``); ``tmp``: scratch."""
    s0, s1, s2 = HASH_SHIFTS
    for shift, mul in ((s0, HASH_MULS[0]), (s1, HASH_MULS[1])):
        h.bitwise_xor_(torch.bitwise_right_shift(h, shift, out=tmp))
        h.mul_(mul).bitwise_and_(_M32)
    return h.bitwise_xor_(torch.bitwise_right_shift(h, s2, out=tmp))


def _bits_(h: torch.Tensor, key: int, start: int, tmp: torch.Tensor) -> torch.Tensor:
    """Fill ``h`` (int64) with the random bits of elements ``start ..`` (see :func:`random_bits`)."""
    torch.arange(start, start + h.numel(), dtype=torch.int64, device=h.device, out=h)
    h.bitwise_and_(_M32).bitwise_xor_(key & _M32)
    return _hash32_(h, tmp).bitwise_xor_((key >> 32) & _M32).bitwise_right_shift_(16)


def random_bits(key: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 random bits ``r`` of elements ``start .. start + n - 1`` under ``key``.

    ``r = (hash32(((start + i) mod 2^32) ^ key_lo) ^ key_hi) >> 16`` (``key_lo``/``key_hi``:
    the key's low and high 32 bits): the high half of the hash, its best-mixed bits.

    Args:
        key: from :func:`round_key`.
        start: the first element's index in its tensor.
        n: how many.
        device: where to compute them.

    Returns:
        int64 tensor [n] of values in [0, 2^16).
    """
    h = torch.empty(n, dtype=torch.int64, device=device)
    return _bits_(h, key, start, torch.empty_like(h))


def _check(out: torch.Tensor, x: torch.Tensor, key: int, offset: int) -> None:
    if out.dtype != torch.bfloat16 or x.dtype != torch.float32:
        raise ConfigError(f"stochastic_round_: rounds float32 into bfloat16, got {x.dtype} into {out.dtype}")
    if out.shape != x.shape:
        raise ConfigError(f"stochastic_round_: out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    if not (out.is_contiguous() and x.is_contiguous()):
        raise ConfigError("stochastic_round_: out and x must be contiguous; call .contiguous() first")
    if not 0 <= key < 2**63 or offset < 0:
        raise ConfigError(f"stochastic_round_: key={key} must be in [0, 2**63) and offset={offset} >= 0")


def stochastic_round_ref_(out: torch.Tensor, x: torch.Tensor, key: int, offset: int) -> None:
    """The reference (any device; checked inputs as :func:`stochastic_round_`): passes of
    ``_SUB`` elements, in place on two int64 scratch buffers (fresh temporaries per op cost
    ~10x the arithmetic on CPU)."""
    flat_x, flat_out = x.view(-1), out.view(torch.int16).view(-1)
    n = flat_x.numel()
    h = torch.empty(min(n, _SUB), dtype=torch.int64, device=x.device)
    tmp = torch.empty_like(h)
    for a in range(0, n, _SUB):
        b = min(a + _SUB, n)
        r, t, xs = _bits_(h[:b - a], key, offset + a, tmp[:b - a]), tmp[:b - a], flat_x[a:b]
        t.copy_(xs.view(torch.int32)).bitwise_and_(_M32)  # the fp32 pattern, unsigned
        r.add_(t).bitwise_right_shift_(16)  # the top 16 bits after adding r: the bf16 pattern
        nan = torch.isnan(xs)
        if nan.any():  # a carry could turn a NaN into -0: keep its truncation
            r[nan] = t[nan] >> 16
        flat_out[a:b] = r.to(torch.int16)  # the low 16 bits, as int16 (a modular cast)


@torch.library.custom_op("outcore::stochastic_round_", mutates_args=("out",))
def _stochastic_round_op(out: torch.Tensor, x: torch.Tensor, key: int, offset: int) -> None:
    """Any device without a kernel of its own: the reference."""
    stochastic_round_ref_(out, x, key, offset)


@_stochastic_round_op.register_kernel("cpu")
def _(out, x, key, offset) -> None:
    """The C++ extension's one-pass loop where it builds (``kernels/csrc/stochastic_round_cpu.h``,
    bit-identical; ~100x the reference's tensor passes), else the reference."""
    from .cpu_ext import cpu_extension  # the CPU kernels' extension, built on first use

    ext = cpu_extension()
    if ext is None:
        stochastic_round_ref_(out, x, key, offset)
    else:
        ext.stochastic_round(out, x, key, offset)


@_stochastic_round_op.register_fake
def _(out, x, key, offset) -> None:  # fake impl: shapes only, nothing to return
    return None


def _triton_impl():
    from .stochastic_round_triton import stochastic_round_triton_

    return stochastic_round_triton_


_maybe_register_triton = cuda_kernel_registrar(_stochastic_round_op, _triton_impl)


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, key: int, offset: int = 0) -> torch.Tensor:
    """Round ``x`` (fp32) stochastically into ``out`` (bf16), in place.

    Args:
        out: bf16 tensor of ``x``'s shape, contiguous, written.
        x: the fp32 values.
        key: the rounding's key (:func:`round_key`).
        offset: the index of ``x``'s first element in the whole tensor it belongs to
            (a piece or chunk of a parameter rounds with the whole's bits).

    Returns:
        ``out``.

    Raises:
        ConfigError: other dtypes, shapes that differ, a non-contiguous tensor, a key out of
            range or a negative offset.
    """
    _check(out, x, key, offset)
    if out.is_cuda:
        _maybe_register_triton()
    elif out.device.type == "cpu" and not torch.compiler.is_compiling():
        from .cpu_ext import cpu_extension

        ext = cpu_extension()
        if ext is not None:  # the op's CPU kernel, without its dispatch (~50 us a call)
            ext.stochastic_round(out, x, int(key), int(offset))
            return out
    torch.ops.outcore.stochastic_round_(out, x, int(key), int(offset))
    return out
