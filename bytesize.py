"""Byte sizes as text: :func:`parse_bytes` reads ``"2GiB"``, :func:`format_bytes` writes ``"1.50 GiB"``.

``parse_bytes`` is the one parser of byte sizes (``--device-mem``, ``--host-mem``, a
config's budgets); ``format_bytes`` writes the sizes error messages and the memory plan's
table show. Low level on purpose: the store and the planner both use it, and it imports
nothing of outcore but ``errors``.
"""
from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float, what: str = "size") -> int:
    """Parse a byte size: ``"2GiB"``, ``"512MB"``, ``"1.5G"``, ``"4096"`` or a number.

    Decimal suffixes (k, M, G, T, with or without ``B``) are powers of 1000; binary
    ones (KiB, MiB, GiB, TiB) powers of 1024. Case is ignored.

    Args:
        value: the size.
        what: the option name for the error message (e.g. ``"--host-mem"``).

    Returns:
        The size in bytes.

    Raises:
        ConfigError: the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is not a byte size; write e.g. 2GiB, 512MB or 1.5G")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _BYTES_RE.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{what}={value!r} is not a byte size; write e.g. 2GiB, 512MB or 1.5G")
        number, unit = float(m.group(1)), m.group(2).lower()
    size = number * _UNITS[unit]  # a huge number times its unit may overflow to inf
    if not number >= 0 or size == float("inf"):
        raise ConfigError(f"{what}={value!r} must be a non-negative byte size, e.g. 2GiB")
    return int(size)


def format_bytes(n: int | float | None) -> str:
    """``1536 << 20`` -> ``"1.50 GiB"`` (binary units; ``"-"`` for None)."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover
