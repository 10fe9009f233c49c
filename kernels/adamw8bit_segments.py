"""Segment tables of the AVX-512 8-bit quantizer (``kernels/csrc/adamw8bit_cpu.cpp``).

Within each decade the dynamic quantile map is linear, so the C++ quantizer reads a code
from the bits of a biased piecewise-linear value instead of searching the map. These
tables hold the pieces, and are verified exhaustively against every threshold interval
when first built; lanes that land next to a code boundary are flagged for the exact
fallback. See :func:`segment_tables`.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from .quantize import dynamic_map, thresholds

SEG_EXP_LO = 96  # binade slots 0..31 = fp32 exponents 96..127 (|y| in [2^-31, 2))
# f is computed as 2048 + code + fraction: in [2048, 4096) an fp32's low 12 mantissa bits are
# the fraction in units of 2^-12 and the next 8 bits the code, so both come out of the bit
# pattern with integer ops. A lane whose fraction is within SEG_NEAR units of an integer
# (f = 2048 + n + [-SEG_NEAR, SEG_NEAR) * 2^-12) takes the exact fallback.
SEG_BIAS = 2048.0
SEG_NEAR = 1
_F32 = np.float32
_UNIT = 2.0 ** -12


def _segment_code_near(f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(code, near) from the biased f, as the kernel extracts them from f's bit pattern."""
    bits = f.astype(_F32).view(np.int32).astype(np.int64)
    return (bits >> 12) & 0xFF, ((bits + SEG_NEAR) & 0xFFF) < 2 * SEG_NEAR


def _segment_code_f(a: np.ndarray, neg: np.ndarray, tab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quantizer's biased f (2048 + code + fraction) and piece for |y| = ``a`` (float32)
    and sign ``neg``, op for op as the C++ kernel computes them (numpy float32 ops are
    IEEE-rounded like the kernel's)."""
    key_bits = a.view(np.int32).astype(np.int64) + neg
    key = key_bits.astype(np.int32).view(_F32)
    slot = np.maximum(key_bits >> 23, SEG_EXP_LO) & 31
    piece = tab[0, slot].astype(np.int64) + (key > tab[1, slot]) + 16 * neg
    f = np.minimum(a, tab[4, piece]) * tab[2, piece] + tab[3, piece]
    return f.astype(_F32), piece


@functools.lru_cache(maxsize=None)
def _segment_table_np(signed: bool) -> np.ndarray:
    q = dynamic_map(signed).numpy()
    t = thresholds(dynamic_map(signed)).numpy()[:255]

    def group(v: float):  # the map's pieces: 0, 1 and each (sign, decade) of linear entries
        return ("0",) if v == 0 else ("1",) if v == 1 else (v > 0, math.floor(math.log10(abs(v))))

    gid = [group(float(v)) for v in q]
    # piece boundaries in |y|: the thresholds between two groups, either sign
    bounds = np.array(sorted({abs(float(t[k])) for k in range(255) if gid[k] != gid[k + 1]}), _F32)
    tab = np.zeros((5, 32), _F32)
    tab[1], tab[4] = np.inf, np.inf
    for s in range(32):  # per binade: boundaries below it, the one inside it (at most one)
        lo, hi = _F32(2.0 ** (s + SEG_EXP_LO - 127)), _F32(2.0 ** (s + SEG_EXP_LO - 126))
        inside = bounds[(bounds >= lo) & (bounds < hi)]
        if len(inside) > 1 or len(bounds) > 15:
            raise AssertionError(f"segment tables: binade {s} holds {len(inside)} boundaries")
        tab[0, s] = (bounds < lo).sum()
        tab[1, s] = inside[0] if len(inside) else np.inf
    tab[3] = SEG_BIAS + 0.5  # unused pieces (never indexed)
    for neg in (0, 1):
        for s in range(len(bounds) + 1):
            col = s + 16 * neg
            lo = bounds[s - 1] if s else _F32(0)
            hi = bounds[s] if s < len(bounds) else _F32(2)
            ks = [k for k in range(255) if lo < (-t[k] if neg else t[k]) < hi]
            if not ks:  # no threshold in the piece: a constant code
                probe = -lo if neg else hi
                tab[2, col], tab[3, col] = 0, SEG_BIAS + (t < probe).sum() + 0.5
                continue
            # f crosses the integer k + 1 at |t[k]|; slope from the group's uniform spacing
            ent = np.sort(np.array([q[j] for j in range(256) if gid[j] == gid[ks[0] + 1]], np.float64))
            spacing = float(np.mean(np.diff(ent))) if len(ent) > 1 else float(abs(ent[0]))
            slope = (-1.0 if neg else 1.0) / spacing
            a_k = np.abs(t[ks].astype(np.float64))
            tab[2, col] = slope
            tab[3, col] = SEG_BIAS + np.mean(np.array(ks) + 1 - a_k * slope)
            tab[4, col] = a_k.max() + 0.5 * spacing  # past the last threshold: hold its code
    _verify_segment_table(tab, bounds, t)
    return tab


def _verify_segment_table(tab: np.ndarray, bounds: np.ndarray, t: np.ndarray) -> None:
    """Exhaustive proof that the fast quantizer is exact wherever it does not flag a lane.

    On each piece (sign, segment) f is monotone in |y| (min, mul, add by constants are), and
    the reference code is constant between consecutive thresholds. So it suffices to check,
    for every such interval, that f at its two end floats lies within (code - m, code + 1 + m):
    then any f in between that is >= m away from every integer floors to the code.

    Raises:
        AssertionError: a piece or an interval violates that (the tables are wrong).
    """
    up, down = (lambda x: np.nextafter(_F32(x), _F32(np.inf))), (lambda x: np.nextafter(_F32(x), _F32(-np.inf)))
    ends, negs, codes, pieces = [], [], [], []
    for neg in (0, 1):
        for s in range(len(bounds) + 1):
            lo = bounds[s - 1] if s else _F32(0)
            hi = bounds[s] if s < len(bounds) else down(_F32(2))
            if neg == 0:  # |y| in (lo, hi]; the code steps just above each threshold
                amin, amax = (lo if s == 0 else up(lo)), hi
                cuts = sorted(_F32(x) for x in t if amin <= x < amax)
                iv = list(zip([amin] + [up(c) for c in cuts], cuts + [amax]))
                code = [int((t < b).sum()) for _, b in iv]
            else:  # |y| in [lo, hi) (the kernel's key is the next float); steps at -threshold
                amin, amax = lo, down(hi)
                cuts = sorted(_F32(-x) for x in t if amin < -x <= amax)
                iv = list(zip([amin] + cuts, [down(c) for c in cuts] + [amax]))
                code = [int((t < -a).sum()) for a, _ in iv]
            for (a, b), c in zip(iv, code):
                ends += [a, b]
                negs += [neg, neg]
                codes += [c, c]
                pieces += [s + 16 * neg] * 2
    f, piece = _segment_code_f(np.array(ends, _F32), np.array(negs, np.int64), tab)
    codes = np.array(codes)
    if not (piece == np.array(pieces)).all():
        raise AssertionError("segment tables: a piece boundary is misplaced")
    # f is a multiple of 2^-12 here; accepted values lie in [n + K u, n + 1 - (K + 1) u]
    # (u = 2^-12, K = SEG_NEAR), so these bounds leave floor(f) = code as the only option.
    lo = SEG_BIAS + codes - (SEG_NEAR + 1) * _UNIT
    hi = SEG_BIAS + codes + 1 + SEG_NEAR * _UNIT
    f64 = f.astype(np.float64)
    bad = ~((f64 > lo) & (f64 < hi) & (f64 >= SEG_BIAS) & (f64 < SEG_BIAS + 256))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"segment tables: |y|={ends[i]!r} (neg={negs[i]}) gives f={f[i]!r}, "
                             f"code {codes[i]}")


def segment_tables(signed: bool) -> Tensor:
    """The AVX-512 quantizer's tables for one dynamic map, verified (see the C++ file).

    Rows: per binade slot (exponent 96 + column) the number of piece boundaries below it and
    the boundary inside it (+inf if none); per piece (column s for y >= 0, 16 + s for y < 0)
    the slope, offset and clamp of f(|y|) = min(|y|, clamp) * slope + offset = 2048 + code +
    fraction (:data:`SEG_BIAS`). Verified exhaustively when first built
    (:func:`_verify_segment_table`).

    Args:
        signed: which dynamic map.

    Returns:
        (5, 32) float32 CPU tensor.
    """
    return torch.from_numpy(_segment_table_np(bool(signed)).copy())
