"""Stdout for the one JSON document of a ``--json`` command, everything else on stderr.

A ``--json`` command promises ``json.load(stdout)`` works. Libraries don't all keep stdout
clean: DeepSpeed binds its logger to ``sys.stdout`` when it is imported and warns there
("Setting accelerator to CPU ..."), and accelerate imports it, where installed, inside
every ``save_pretrained`` (``extract_model_from_parallel``), so a command that writes a
GGUF cache or a trial model printed that line ahead of its JSON.

    with json_stdout(args.json):
        ...                          # prints, loggers, child processes: stderr
        emit_json(json.dumps(result))  # the document: the real stdout

Inside ``json_stdout(True)``, ``sys.stdout`` is ``sys.stderr``, so a handler bound to
``sys.stdout`` meanwhile (DeepSpeed's) writes to stderr for good. Where ``sys.stdout`` is
the process's own stdout, its file descriptor is pointed at stderr's as well, which
catches what holds the descriptor rather than the object: a handler bound before, C code,
child processes. ``emit_json`` writes to the stdout saved on entry.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO

_document: TextIO | None = None  # where emit_json writes while json_stdout is active


def _fileno(stream: object) -> int | None:
    try:
        return stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):  # StringIO, pytest's capture, a closed stream
        return None


def _flush(*streams: object) -> None:
    for s in streams:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            s.flush()  # type: ignore[attr-defined]


@contextlib.contextmanager
def json_stdout(enabled: bool = True) -> Iterator[None]:
    """Send everything but :func:`emit_json`'s document to stderr while the block runs.

    Args:
        enabled: False (no ``--json``): nothing changes. Nested uses are the outer one.
    """
    global _document
    if not enabled or _document is not None:
        yield
        return
    real, err = sys.stdout, sys.stderr
    _flush(real, err)
    fd, err_fd = _fileno(real), _fileno(err)
    saved = None
    if real is sys.__stdout__ and fd is not None and err_fd is not None and fd != err_fd:
        saved = os.dup(fd)  # the real stdout, for the document
        os.dup2(err_fd, fd)
        _document = io.TextIOWrapper(io.FileIO(saved, "w", closefd=False),
                                     encoding=getattr(real, "encoding", None) or "utf-8")
    else:
        _document = real
    try:
        with contextlib.redirect_stdout(err):
            yield
    finally:
        document, _document = _document, None
        _flush(real, err, document)
        if saved is not None:
            with contextlib.suppress(ValueError, OSError):  # a broken pipe: already reported
                document.close()
            os.dup2(saved, fd)
            os.close(saved)


def emit_json(text: str) -> None:
    """Print ``text`` (one JSON document) and a newline on stdout: the real one inside
    :func:`json_stdout`, else ``sys.stdout``."""
    out = _document if _document is not None else sys.stdout
    out.write(text + "\n")
    out.flush()
