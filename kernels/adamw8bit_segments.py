"""Segment tables of the AVX-512 8-bit quantizer (``kernels/csrc/adamw8bit_cpu.cpp``).

Within each decade the dynamic quantile map is linear, so the C++ quantizer does not search
the map: it evaluates a piecewise-linear ``f(|y|)`` whose integer part is the code. These
tables hold the pieces (positive side only: a negative value's code mirrors the code of its
magnitude, see :func:`segment_code`). They are verified exhaustively against every threshold
interval when first built (:func:`_verify_segment_table`), which proves the quantizer's
contract: a code equals the reference's ``searchsorted`` code except for values within
:data:`SEG_TOL` code spacings of a threshold, and there it differs by exactly one.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from .quantize import dynamic_map, thresholds

# Slots of two binades each: slot s holds fp32 exponents 96 + 2s and 97 + 2s (|y| in
# [2^(2s-31), 2^(2s-29))), s = 0..15, i.e. (bits >> 24) - SEG_SLOT_LO; smaller |y| use slot 0.
# 16 slots make the kernel's slot lookups one-register permutes; the map's piece boundaries
# are ~3.3 binades apart, so a slot never holds two of them (checked).
SEG_SLOT_LO = 48
SEG_COLS = 16
# f = fma(min(k, clamp), slope, offset) (one rounding) is linear within a piece and crosses
# the integer c + 1 at threshold c up to the fit error of one line through several
# fp32-rounded thresholds. Verified bound on that error, in code units (measured: < 2e-5).
SEG_TOL = 2.0 ** -14
_F32 = np.float32


def _fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fused multiply-add with one rounding (to nearest even), as the hardware's.

    Exact in rationals, then one correct rounding to fp32 (no double rounding through
    float64). Slow; for the few thousand table end points only.
    """
    out = np.empty(a.shape, _F32)
    for i, (x, y, z) in enumerate(zip(a.tolist(), b.tolist(), c.tolist())):
        if not (math.isfinite(x) and math.isfinite(y) and math.isfinite(z)):
            out[i] = _F32(x * y + z)
            continue
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


def segment_f(a: np.ndarray, neg: np.ndarray, tab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's f and piece for |y| = ``a`` (float32) and sign ``neg`` (0/1), op for op.

    The key k is a, or the next float above a where y < 0 (there the reference's ties go the
    other way: code(-a) counts thresholds <= a, not < a). Returns f and the table column used.
    """
    key_bits = a.view(np.int32).astype(np.int64) + neg
    key = key_bits.astype(np.int32).view(_F32)
    slot = np.maximum(key_bits >> 24, SEG_SLOT_LO) & 15
    col = (slot + (key_bits > tab[0].view(np.int32)[slot])) & 15
    f = _fma_f32(np.minimum(key, tab[3, col]), tab[1, col], tab[2, col])
    return f, col


def segment_code(f: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """The code the kernel stores: c = trunc(f) saturated to [0, 255], and for y < 0 the
    mirror 254 - c saturated at 0 (the signed map is symmetric about its code 127, 0.0,
    except for 1.0, code 255, which has no negative twin)."""
    c = np.clip(np.trunc(f.astype(np.float64)), 0, 255).astype(np.int64)
    return np.where(neg.astype(bool), np.maximum(254 - c, 0), c)


def _segment_table_np(signed: bool) -> np.ndarray:
    return _build(bool(signed))[0]


@functools.lru_cache(maxsize=None)
def _build(signed: bool) -> tuple[np.ndarray, float]:
    q = dynamic_map(signed).numpy()
    t = thresholds(dynamic_map(signed)).numpy()[:255]

    def group(v: float):  # the map's pieces: 0, 1 and each decade of linear entries
        return ("0",) if v == 0 else ("1",) if v == 1 else (v > 0, math.floor(math.log10(abs(v))))

    gid = [group(float(v)) for v in q]
    # piece boundaries: the positive thresholds between two groups
    bounds = np.array(sorted(float(t[k]) for k in range(255) if t[k] > 0 and gid[k] != gid[k + 1]), _F32)
    if len(bounds) >= SEG_COLS:
        raise AssertionError(f"segment tables: {len(bounds) + 1} pieces do not fit {SEG_COLS} columns")
    pieces = []  # (slope, offset, clamp) per piece, in order of |y|
    for s in range(len(bounds) + 1):
        lo = bounds[s - 1] if s else _F32(0)
        hi = bounds[s] if s < len(bounds) else _F32(2)
        ks = [k for k in range(255) if lo < t[k] < hi]
        if not ks:  # no threshold in the piece: a constant code
            pieces.append((0.0, (t < hi).sum() + 0.5, np.inf))
            continue
        # f crosses the integer k + 1 at t[k]; slope from the group's uniform spacing, offset
        # centred between the extreme misfits of the piece's thresholds
        ent = np.sort(np.array([q[j] for j in range(256) if gid[j] == gid[ks[0] + 1]], np.float64))
        spacing = float(np.mean(np.diff(ent))) if len(ent) > 1 else float(abs(ent[0]))
        slope = _F32(1.0 / spacing)
        r = np.array(ks) + 1 - t[ks].astype(np.float64) * float(slope)
        # past the last threshold: hold its code
        pieces.append((slope, (r.max() + r.min()) / 2, t[ks].max() + 0.5 * spacing))
    tab = np.zeros((4, SEG_COLS), _F32)
    for s in range(16):  # slot s: its boundary (at most one), its top piece in column s + 1
        lo = _F32(2.0 ** (2 * s + 2 * SEG_SLOT_LO - 127))
        hi = _F32(2.0 ** (2 * s + 2 * SEG_SLOT_LO - 125))
        inside = bounds[(bounds >= lo) & (bounds < hi)]
        if len(inside) > 1:
            raise AssertionError(f"segment tables: slot {s} holds {len(inside)} boundaries")
        tab[0, s] = inside[0] if len(inside) else np.int32(-1).view(_F32)  # -1: k > it always
        tab[1:, (s + 1) % 16] = pieces[int((bounds < hi).sum())]
    return tab, _verify_segment_table(tab, bounds, t)


def _intervals(bounds: np.ndarray, t: np.ndarray, neg: int) -> list[tuple[np.float32, np.float32, int, int]]:
    """(first |y|, last |y|, reference code, piece) of every run of |y| with one reference
    code inside one piece, for y >= 0 (neg=0) or y < 0 (neg=1)."""
    def up(x):
        return np.nextafter(_F32(x), _F32(np.inf))

    def down(x):
        return np.nextafter(_F32(x), _F32(-np.inf))

    out = []
    for s in range(len(bounds) + 1):
        lo = bounds[s - 1] if s else _F32(0)
        hi = bounds[s] if s < len(bounds) else down(_F32(2))
        if neg == 0:  # |y| in (lo, hi]: the kernel's piece test is k > boundary
            amin, amax = (lo if s == 0 else up(lo)), hi
            cuts = sorted(_F32(x) for x in t if amin <= x < amax)
            runs = list(zip([amin] + [up(c) for c in cuts], cuts + [amax]))
            out += [(a, b, int((t < b).sum()), s) for a, b in runs]
        else:  # |y| in [lo, hi) (k is the next float above |y|); steps at -threshold
            amin, amax = lo, down(hi)
            cuts = sorted(_F32(-x) for x in t if amin < -x <= amax)
            runs = list(zip([amin] + cuts, [down(c) for c in cuts] + [amax]))
            out += [(a, b, int((t < -a).sum()), s) for a, b in runs]
    return out


def _verify_segment_table(tab: np.ndarray, bounds: np.ndarray, t: np.ndarray) -> float:
    """Exhaustive proof of the quantizer's tolerance (see :data:`SEG_TOL`).

    Within a piece f is monotone in |y| (min, then a correctly rounded fma with constants),
    and the reference code is constant on each run between consecutive thresholds. So it
    suffices to check, for every run, that f at its two end floats lies within SEG_TOL of
    [c, c + 1), c the positive code the run must produce (the reference code, or for y < 0
    its mirror 254 - code): then every value inside gets its reference code, or one off
    where its f is within SEG_TOL of an integer. Saturated ends (codes 0 and 255, and the
    mirror of 0) are bounded on their inner side only.

    Returns:
        the largest distance (code units) by which an end point's f leaves its [c, c + 1).

    Raises:
        AssertionError: a piece or a run violates that (the tables are wrong).
    """
    has_neg = bool((t < 0).any())
    runs = [(a, b, c, s, neg) for neg in ((0, 1) if has_neg else (0,)) for a, b, c, s in _intervals(bounds, t, neg)]
    ends = np.array([x for a, b, *_ in runs for x in (a, b)], _F32)
    negs = np.repeat(np.array([r[4] for r in runs]), 2)
    ref = np.repeat(np.array([r[2] for r in runs]), 2)
    f, col = segment_f(ends, negs, tab)
    # the piece of column j: the top piece of slot j - 1, i.e. boundaries below that slot's end
    col_piece = np.array([(bounds < _F32(2.0 ** (2 * ((j - 1) % 16) + 2 * SEG_SLOT_LO - 125))).sum()
                          for j in range(16)])
    if not (col_piece[col] == np.repeat(np.array([r[3] for r in runs]), 2)).all():
        raise AssertionError("segment tables: a piece boundary is misplaced")
    cpos = np.where(negs == 1, np.minimum(254 - ref, 254), ref)  # the positive code to produce
    free_lo = cpos == 0
    free_hi = (cpos == 255) | ((negs == 1) & (ref == 0))  # 254 and 255 both mirror to 0
    f64 = f.astype(np.float64)
    below = np.where(free_lo, 0.0, np.maximum(cpos - f64, 0.0))
    above = np.where(free_hi, 0.0, np.maximum(f64 - (cpos + 1) + 2.0 ** -24, 0.0))
    miss = np.maximum(below, above)
    bad = miss > SEG_TOL
    if bad.any() or not (segment_code(f, negs)[~(miss > 0)] == ref[~(miss > 0)]).all():
        i = int(np.flatnonzero(bad)[0]) if bad.any() else -1
        raise AssertionError(f"segment tables: |y|={ends[i]!r} (neg={negs[i]}) gives f={f[i]!r}, "
                             f"reference code {ref[i]}")
    return float(miss.max())


def segment_misfit(signed: bool) -> float:
    """Largest distance (in code units) by which the tables' f misses the reference's code
    interval at any threshold: the measured counterpart of :data:`SEG_TOL` (for tests)."""
    return _build(bool(signed))[1]


def segment_tables(signed: bool) -> Tensor:
    """The AVX-512 quantizer's tables for one dynamic map, verified (see the C++ file).

    Row 0: per slot (column s: fp32 exponents 96 + 2s, 97 + 2s) the piece boundary inside
    it, or the bit pattern of int32 -1 where none. Rows 1-3: the slope, offset and clamp of
    f(k) = fma(min(k, clamp), slope, offset) for the piece at the top of slot j - 1 (mod 16)
    in column j; the truncation of f is the positive code (:func:`segment_code`). A key k in
    slot s uses column s + (k > boundary[s]). Verified exhaustively when first built
    (:func:`_verify_segment_table`).

    Args:
        signed: which dynamic map.

    Returns:
        (4, 16) float32 CPU tensor.
    """
    return torch.from_numpy(_segment_table_np(bool(signed)).copy())
