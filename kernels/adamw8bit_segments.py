"""Segment tables of the vector 8-bit quantizer (``kernels/csrc``: the AVX2 and AVX-512 paths).

Within each decade the dynamic quantile map is linear, so the C++ quantizer does not search
the map: it evaluates a piecewise-linear ``f(|y|)`` whose integer part is the code, and sends
the rare values whose ``f`` lies within a guard band of an integer (next to a threshold) to
the exact scalar method (``kernels/quantize.py``: bucket table + one comparison). These
tables hold the pieces (positive side only: a negative value's code mirrors the code of its
magnitude). They are verified exhaustively when first built (:func:`_verify`): every value
whose ``f`` is outside the guard band gets the reference's ``searchsorted`` code, so the
kernel's codes are the reference's bit for bit.

The model below is the kernel's arithmetic op for op (:func:`segment_code`):

* key ``k``: the bit pattern of ``|y|``, plus one (the next float) where ``y < 0``: there the
  reference's ties go the other way (``code(-a)`` counts thresholds ``<= a``), which matters
  at the piece boundaries (elsewhere ties are guarded);
* slot ``q = (max(k >> 23, SEG_E_LO) * SEG_SLOT_MUL) >> 16``: three binades per slot (a
  16-bit multiply, no division), each holding exactly one piece boundary;
* column ``j = (q + (k > boundary[q & 7])) & 7`` (integer compare: non-negative floats order
  like their bit patterns): eight pieces, so every lookup reads one 8-entry register;
* ``f = fma(min(a, clamp[j]), slope[j], offset[j])``, ``a`` the key (AVX2) or ``|y|``
  (AVX-512, which rotates the key out of y's bits; both are verified), one rounding, biased by
  :data:`SEG_BIAS` + SEG_NEAR units of 2^-15: ``f`` lies in [256, 512), its bits 15..22 are
  the code and the 15 bits below its fraction;
* the code: ``c = (bits(f) >> 15) - 0x8700``, and ``254 - c`` saturated at 0 where ``y < 0``
  (the signed map is symmetric about its code 127, 0.0, except for 1.0, code 255);
* the guard: ``(bits(f) & 0x7FFF) < 2 * SEG_NEAR``: f, less its SEG_NEAR units, within
  SEG_NEAR units of 2^-15 of an integer (the bias makes that test one AND).
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from .quantize import dynamic_map, thresholds

SEG_COLS = 8
# |y| below 2^-20 (fp32 exponent 107) shares the bottom slot; slot q = (e * SEG_SLOT_MUL) >> 16
# is 36 + (e - 107) // 3 for e = 107..127 (checked), and 43 for |y| in [2, 16).
SEG_E_LO = 107
SEG_SLOT_MUL = 22100
SEG_BIAS = 256.0
_BIAS_BITS = 0x43800000  # bits of 256.0: f's bits are _BIAS_BITS + code * 2^15 + fraction
SEG_NEAR = 2  # guard band: f within 2 units of 2^-15 of an integer (verified sufficient)
_BIAS = SEG_BIAS + SEG_NEAR * 2.0 ** -15  # the offsets' bias: the guard test is one AND
_F32 = np.float32
_NONE = np.int32(0x7FFFFFFF)  # boundary of a slot without one: no key is above it


def _fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fused multiply-add with one rounding (to nearest even), as the hardware's.

    Exact in rationals, then one correct rounding to fp32 (no double rounding through
    float64). Slow; for the few thousand table end points only.
    """
    out = np.empty(a.shape, _F32)
    for i, (x, y, z) in enumerate(zip(a.tolist(), b.tolist(), c.tolist())):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        r = _F32(float(exact))
        lo, hi = ((r, np.nextafter(r, _F32(np.inf))) if Fraction(float(r)) <= exact
                  else (np.nextafter(r, _F32(-np.inf)), r))
        mid = (Fraction(float(lo)) + Fraction(float(hi))) / 2
        if exact != mid:
            out[i] = lo if exact < mid else hi
        else:  # a tie: the even mantissa
            out[i] = lo if (int(lo.view(np.int32)) & 1) == 0 else hi
    return out


def segment_key(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key bits as int64, neg 0/1) of float32 values ``y`` (see the module docstring)."""
    bits = y.astype(_F32).view(np.int32).astype(np.int64)
    neg = (bits < 0).astype(np.int64)
    return (bits & 0x7FFFFFFF) + neg, neg


def segment_column(key: np.ndarray, tab: np.ndarray) -> np.ndarray:
    """The table column the kernel reads for each key (int64 key bits)."""
    q = (np.maximum(key >> 23, SEG_E_LO) * SEG_SLOT_MUL) >> 16
    bnd = tab[0].view(np.int32).astype(np.int64)
    return (q + (key > bnd[q & 7])) & 7


def segment_f(key: np.ndarray, a: np.ndarray, tab: np.ndarray) -> np.ndarray:
    """The kernel's biased f (float32) for int64 key bits and the bits ``a`` it reads (the key,
    or |y| = key - neg)."""
    col = segment_column(key, tab)
    clamp = tab[3].view(np.int32).astype(np.int64)[col]
    a = np.minimum(a, clamp).astype(np.int32).view(_F32)
    return _fma_f32(a, tab[1, col], tab[2, col])


def segment_code(y: np.ndarray, tab: np.ndarray, f_of_key: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(codes, guarded) as the kernel computes them for float32 ``y`` (f of the key: AVX2, or of
    |y|: AVX-512): ``guarded`` marks the values the kernel hands to the exact scalar method
    (their code here is meaningless)."""
    key, neg = segment_key(y)
    bits = segment_f(key, key if f_of_key else key - neg, tab).view(np.int32).astype(np.int64)
    c = (bits >> 15) - (_BIAS_BITS >> 15)
    code = np.where(neg == 1, np.maximum(254 - c, 0), c)
    guarded = (bits & 0x7FFF) < 2 * SEG_NEAR
    return code, guarded


def _pieces(signed: bool) -> tuple[np.ndarray, list[tuple[float, float, float]]]:
    """The piece boundaries (positive thresholds between two of the map's linear groups) and
    each piece's (slope, biased offset, clamp)."""
    q = dynamic_map(signed).numpy()
    t = thresholds(dynamic_map(signed)).numpy()[:255]

    def group(v: float):  # the map's linear groups: 1 and each decade of either sign
        return ("1",) if v == 1 else (v > 0, math.floor(math.log10(abs(v))))

    zero = group(float(q[q > 0].min()))  # 0 joins the lowest positive decade: one line
    gid = [zero if v == 0 else group(float(v)) for v in q]
    bounds = np.array(sorted(float(t[k]) for k in range(255) if t[k] > 0 and gid[k] != gid[k + 1]), _F32)
    pieces = []
    for s in range(len(bounds) + 1):
        lo = bounds[s - 1] if s else _F32(0)
        hi = bounds[s] if s < len(bounds) else _F32(2)
        ks = [k for k in range(255) if lo < t[k] < hi]
        if not ks:  # no threshold inside: a constant code
            pieces.append((0.0, int((t < hi).sum()) + 0.5 + _BIAS, np.inf))
            continue
        tk = t[ks].astype(np.float64)
        # f crosses the integer k + 1 at t[k]: the slope from the thresholds' mean spacing (one
        # threshold: f = code + 0.5 at |y| = 0), the offset centred between the extreme misfits
        spacing = (tk[-1] - tk[0]) / (len(ks) - 1) if len(ks) > 1 else 2 * tk[0]
        slope = _F32(1.0 / spacing)
        r = np.array(ks) + 1 - tk * float(slope)
        pieces.append((slope, (r.max() + r.min()) / 2 + _BIAS, tk.max() + 0.5 * spacing))
    return bounds, pieces


@functools.lru_cache(maxsize=None)
def _build(signed: bool) -> np.ndarray:
    bounds, pieces = _pieces(signed)
    if len(pieces) != SEG_COLS:
        raise AssertionError(f"segment tables: {len(pieces)} pieces, the kernel reads {SEG_COLS}")
    q0 = (SEG_E_LO * SEG_SLOT_MUL) >> 16
    e = np.arange(131)
    if not (((np.maximum(e, SEG_E_LO) * SEG_SLOT_MUL) >> 16)
            == np.where(e < 128, q0 + np.maximum(e - SEG_E_LO, 0) // 3, q0 + 7)).all():
        raise AssertionError("segment tables: the slot multiplier does not give 3-binade slots")
    tab = np.zeros((4, SEG_COLS), _F32)
    tab[0] = _NONE.view(_F32)
    for i, b in enumerate(bounds):  # slot q0 + i: exponents SEG_E_LO + 3i .. + 2, boundary i
        e = int(b.view(np.int32)) >> 23
        if (max(e, SEG_E_LO) * SEG_SLOT_MUL) >> 16 != q0 + i:
            raise AssertionError(f"segment tables: boundary {b!r} is not in slot {q0 + i}")
        tab[0, (q0 + i) & 7] = b
    for p, (slope, off, clamp) in enumerate(pieces):  # slot q0 + p's lower piece, column q0 + p
        tab[1:, (q0 + p) & 7] = (slope, off, _F32(clamp))
    _verify(tab, bounds, signed)
    return tab


def _verify(tab: np.ndarray, bounds: np.ndarray, signed: bool) -> None:
    """Exhaustive proof that unguarded values get the reference's code.

    Within a piece f is non-decreasing in the key (min, then a correctly rounded fma with a
    slope >= 0; f of the key or of |y| = key - neg, both checked), and so is the code the
    reference asks for (its mirror for y < 0). The keys where that code can change are the
    thresholds' bit patterns and the next two above them; between two such keys it is
    constant, so checking f at both ends of every run suffices: f must lie in [256, 512), the
    run's code c must be f's integer part, and every f of the run with another integer part
    must be guarded. f carries SEG_NEAR units of 2^-15 of bias, so in those units that is
    f_lo >= c and f_hi < c + 1 + 2 * SEG_NEAR. The piece each end lands in is checked too.

    Raises:
        AssertionError: a run violates that (the tables are wrong).
    """
    t = thresholds(dynamic_map(signed)).numpy()[:255]
    tb = np.abs(t).view(np.int32).astype(np.int64)
    cand = np.unique(np.concatenate([tb, tb + 1, tb + 2]))
    bb = bounds.view(np.int32).astype(np.int64)
    top = int(_F32(2.0).view(np.int32))  # |y| < 2: y = x / absmax of its block
    edges = np.concatenate([[0], bb + 1, [top]])  # piece p: keys in [edges[p], edges[p + 1])
    q0 = (SEG_E_LO * SEG_SLOT_MUL) >> 16
    unit = 1 << 15
    for neg in ((0, 1) if signed else (0,)):
        for p in range(len(edges) - 1):
            lo, hi = int(edges[p]) + neg * (p == 0), int(edges[p + 1])  # y < 0: keys start at 1
            cuts = [lo] + [int(k) for k in cand if lo < k < hi] + [hi]
            starts = np.array(cuts[:-1], np.int64)
            ends = np.array(cuts[1:], np.int64) - 1
            a = (starts - neg).astype(np.int32).view(_F32)  # |y| of each run's first key
            ref = np.searchsorted(t, -a if neg else a, side="left")
            want = np.where(neg == 1, 254 - ref, ref)
            free_hi = (want >= 255) | ((neg == 1) & (ref == 0))  # 254 and 255 both give 0
            want = np.minimum(want, 254 if neg else 255)
            keys = np.concatenate([starts, ends])
            if not (segment_column(keys, tab) == (q0 + p) & 7).all():
                raise AssertionError(f"segment tables: a key of piece {p} reads another column")
            for a in (keys, keys - neg):  # f of the key (AVX2) or of |y| (AVX-512)
                u = segment_f(keys, a, tab).view(np.int32).astype(np.int64) - _BIAS_BITS
                ulo, uhi = u[: len(starts)], u[len(starts):]
                ok = ((u >= 0) & (u < 256 * unit)).all()
                ok &= (ulo >= want * unit).all()
                ok &= (free_hi | (uhi < (want + 1) * unit + 2 * SEG_NEAR)).all()
                if not ok:
                    raise AssertionError(f"segment tables: piece {p} (neg={neg}) misses its codes")


def segment_tables(signed: bool) -> Tensor:
    """The vector quantizer's tables for one dynamic map, verified (see the module docstring).

    Row 0: per slot (column ``q & 7``) the piece boundary inside it, as fp32 bits; rows 1-3:
    per piece (column ``(36 + piece) & 7``) the slope, biased offset and clamp of f.

    Args:
        signed: which dynamic map.

    Returns:
        (4, 8) float32 CPU tensor.
    """
    return torch.from_numpy(_build(bool(signed)).copy())
