"""Formatting of bytes, durations, rates and small sparklines for humans.

Pure functions, no third-party imports: the dashboard, the plain log lines, the
summary and ``outcore doctor`` all print numbers through these, so a value is
spelled the same way everywhere (one name per concept, docs/architecture.md §13).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from ..events import perplexity  # noqa: F401 - defined beside EvalEvent; the views print it from here

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_BLOCKS = "▁▂▃▄▅▆▇█"


def fmt_bytes(n: float | int | None) -> str:
    """Binary-prefixed size: ``1536 -> '1.5 KiB'``, ``None -> '-'``.

    Args:
        n: a byte count (may be negative for deltas, or None for "unknown").

    Returns:
        A short string with at most 3 significant digits before the unit.
    """
    if n is None:
        return "-"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.1f} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def fmt_duration(seconds: float | None) -> str:
    """``h:mm:ss`` (or ``m:ss`` under an hour); ``None``/NaN/inf -> ``'-'``.

    Args:
        seconds: a non-negative duration.

    Returns:
        E.g. ``'0:07'``, ``'12:03'``, ``'2:00:10'``, ``'3d 4:00:00'``.
    """
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    total = int(round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def fmt_seconds(seconds: float | None) -> str:
    """A short duration with a unit, for step times: ``'0.41 s'``, ``'85 ms'``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 100:
        return f"{seconds:.2f} s"
    return fmt_duration(seconds)


def fmt_gbps(gbps: float | None) -> str:
    """A bandwidth in GB/s (decimal, as disks are rated): ``'2.15 GB/s'``, ``'640 MB/s'``."""
    if gbps is None or not math.isfinite(gbps):
        return "-"
    if gbps <= 0:
        return "0"
    if gbps < 1.0:
        return f"{gbps * 1000:.0f} MB/s"
    return f"{gbps:.2f} GB/s"


def fmt_count(x: float | None) -> str:
    """A rate or count with thousands separators: ``12345.6 -> '12,346'``, small values keep a decimal."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:,.1f}" if abs(x) < 100 else f"{x:,.0f}"


def fmt_float(x: float | None, digits: int = 4) -> str:
    """A loss-like value: ``'2.3456'``; ``None`` -> ``'-'``; NaN/inf spelled out."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}"


def fmt_lr(lr: float | None) -> str:
    """A learning rate in scientific notation: ``'5.00e-05'``."""
    return "-" if lr is None else f"{lr:.2e}"


def fmt_percent(share: float | None) -> str:
    """A share in [0, 1] as a percentage: ``0.123 -> '12.3%'``."""
    if share is None or not math.isfinite(share):
        return "-"
    return f"{share * 100:.1f}%" if share < 0.1 else f"{share * 100:.0f}%"


def sparkline(values: Iterable[float | None], width: int = 32) -> str:
    """A one-line chart of the last ``width`` values with eighth-block characters.

    Args:
        values: the series, oldest first; None and non-finite values are skipped.
        width: the most characters to draw (the newest values are kept).

    Returns:
        A string of at most ``width`` block characters (empty for no data); a flat
        series draws as a flat mid-height line.
    """
    if width < 1:
        raise ValueError(f"width={width!r} must be >= 1")
    data = [float(v) for v in values if v is not None and math.isfinite(v)][-width:]
    if not data:
        return ""
    lo, hi = min(data), max(data)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return _BLOCKS[3] * len(data)
    scale = (len(_BLOCKS) - 1) / (hi - lo)
    return "".join(_BLOCKS[int(round((v - lo) * scale))] for v in data)
