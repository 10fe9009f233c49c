"""A seam for crash trials: kill this process at a named point of its work.

``scripts/trial_faults.py`` sets ``OUTCORE_FAULT_AT=NAME`` (or ``NAME:N``, the N-th
time that point is reached, counting from 1) and the process SIGKILLs itself there,
as ``kill -9`` or a power cut would: no ``finally``, no flush, no ``atexit``. The
points are one-line calls, ``fault_point("name")``, inside a unit's write-back, between
the files of a checkpoint, during eval and during export.

Unset (every real run), a point costs one comparison: the variable is read once, at
import.
"""
from __future__ import annotations

import os
import signal

ENV = "OUTCORE_FAULT_AT"


def _parse(spec: str) -> tuple[str | None, int]:
    name, _, nth = spec.strip().partition(":")
    return (name or None), (int(nth) if nth else 1)


_TARGET, _NTH = _parse(os.environ.get(ENV, ""))
_hits = 0


def fault_point(name: str) -> None:
    """SIGKILL this process if ``OUTCORE_FAULT_AT`` names this point and this is its N-th hit.

    Args:
        name: the point's name (``unit_write_back``, ``checkpoint_file``, ``eval``, ...).
    """
    if name != _TARGET:
        return
    global _hits
    _hits += 1
    if _hits == _NTH:
        os.kill(os.getpid(), signal.SIGKILL)
