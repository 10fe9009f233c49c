"""Keep a ``--json`` script's stdout pure JSON: everything else goes to stderr.

Libraries print to stdout as they import or run (DeepSpeed's accelerator line, torch's C++
warnings, a compiler's progress), some from C through file descriptor 1 itself, so replacing
``sys.stdout`` is not enough. :func:`claim_stdout` points descriptor 1 at stderr for the rest
of the process (and for the children it starts, which inherit it) and keeps a duplicate of the
original stdout, on which :meth:`JsonOut.emit` writes the one JSON object.

Shared by the bench scripts (scripts/ is not a package: import with scripts/ on sys.path).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any


class JsonOut:
    """The original stdout, kept for the one JSON object."""

    def __init__(self, fd: int | None):
        self._fd = fd

    def emit(self, obj: Any) -> None:
        """Write ``obj`` as JSON (one object, then a newline) to the original stdout."""
        text = json.dumps(obj, indent=1, allow_nan=True) + "\n"
        if self._fd is None:  # not claimed: plain stdout
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        os.write(self._fd, text.encode())


def claim_stdout(enabled: bool = True) -> JsonOut:
    """From here on, descriptor 1 (and ``sys.stdout``) write to stderr; returns the JSON channel.

    Args:
        enabled: False leaves stdout alone (the human-readable mode of a script).
    """
    if not enabled:
        return JsonOut(None)
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # C code and child processes writing to fd 1 now reach stderr
    return JsonOut(saved)
