"""Files written whole or not at all: a temp file beside the target, fsynced, then renamed over
it (``os.replace`` is atomic on one filesystem), so a reader or a crash never sees half a file."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def write_atomic(path: Path, write: Callable[[BinaryIO], None], suffix: str = "") -> None:
    """Create or replace ``path`` with what ``write`` writes to the file object it is given.

    Raises:
        OSError: the write, fsync or rename failed (a full disk); ``path`` is then unchanged
            and the temp file removed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
