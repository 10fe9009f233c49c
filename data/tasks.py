"""Labelled task files (JSONL) for ``outcore eval --task`` and ``finetune eval_task=``.

One JSON object per line, a multiple-choice question or a classification example::

    {"query": "To be, or not to be, that is the", "choices": ["question", "answer"], "gold": 0}

Each choice is scored as the continuation ``query + " " + choice`` (see
``recipes/evaluate.py``); a classification task lists its label words as the choices
of every line. The common shapes of other datasets are accepted too:

* the query under ``query``, ``question``, ``context`` or ``ctx``;
* the choices under ``choices``, ``endings`` or ``options``: a list of strings, or
  ``{"text": [...], "label": [...]}`` (ARC's shape);
* the answer under ``gold``, ``answer``, ``label`` or ``answerKey``: the index of the
  right choice, its text, or its letter (``"B"``, or one of ``choices.label``).

Nothing is downloaded: the file is read as it is. ``shakespeare`` names the task shipped
with outcore (``data/shakespeare_mc.jsonl``: 40 famous lines, which word completes each).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DataError
from ._sources import iter_jsonl

QUERY_KEYS = ("query", "question", "context", "ctx")
CHOICES_KEYS = ("choices", "endings", "options")
GOLD_KEYS = ("gold", "answer", "label", "answerKey")
FORMAT_HINT = '{"query": "...", "choices": ["...", "..."], "gold": 0}'
BUILTIN_TASKS = {"shakespeare": Path(__file__).with_name("shakespeare_mc.jsonl")}


@dataclass(frozen=True)
class TaskItem:
    """One labelled example: the context, the candidate answers and the right one's index."""

    query: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    """A task file's examples, in file order."""

    name: str  # the file's stem, e.g. "shakespeare_mc"
    path: Path
    items: tuple[TaskItem, ...]


def load_task(path: str | Path, limit: int = 0) -> Task:
    """Read a task JSONL file (the format in this module's docstring).

    Args:
        path: the ``.jsonl`` file, or the name of a task shipped with outcore (``shakespeare``).
        limit: keep the first ``limit`` examples (0 = all).

    Returns:
        The Task.

    Raises:
        DataError: a missing or unreadable file, invalid JSON, a line without a query,
            choices or answer, fewer than two choices, an answer that names no choice,
            or a file with no example; each names the file (and line) and the format.
    """
    p = BUILTIN_TASKS.get(str(path), Path(path))
    if not p.is_file():
        raise DataError(f"task file {str(p)!r} not found; pass a JSONL file of lines like {FORMAT_HINT}")
    items: list[TaskItem] = []
    for where, row in iter_jsonl([p]):
        items.append(parse_item(row, where))
        if limit and len(items) >= limit:
            break
    if not items:
        raise DataError(f"task file {str(p)!r} has no example; add lines like {FORMAT_HINT}")
    return Task(name=p.stem, path=p, items=tuple(items))


def parse_item(row: dict[str, Any], where: str) -> TaskItem:
    """One task line as a TaskItem.

    Args:
        row: the parsed JSON object.
        where: ``file:line``, for messages.

    Returns:
        The TaskItem.

    Raises:
        DataError: a missing or malformed query, choices or answer (message names ``where``).
    """
    query = _first(row, QUERY_KEYS, where, "the query")
    if not isinstance(query, str):
        raise DataError(f"{where}: the query must be a string, got {query!r}")
    raw = _first(row, CHOICES_KEYS, where, "the choices")
    labels: list[str] = []
    if isinstance(raw, dict) and "text" in raw:
        labels = [str(x) for x in raw.get("label", [])]
        raw = raw["text"]
    if not isinstance(raw, list) or len(raw) < 2 or not all(isinstance(c, str) and c for c in raw):
        raise DataError(f"{where}: the choices must be a list of at least two non-empty strings, got {raw!r}")
    gold = _gold(_first(row, GOLD_KEYS, where, "the answer"), raw, labels, where)
    return TaskItem(query=query, choices=tuple(raw), gold=gold)


def _first(row: dict[str, Any], keys: tuple[str, ...], where: str, what: str) -> Any:
    for key in keys:
        if key in row:
            return row[key]
    raise DataError(f"{where}: no {what} (one of the keys {', '.join(keys)}); "
                    f"expected lines like {FORMAT_HINT}")


def _gold(answer: Any, choices: list[str], labels: list[str], where: str) -> int:
    """The right choice's index from an index, a choice's text, or its letter / label."""
    n = len(choices)
    if isinstance(answer, bool):
        raise DataError(f"{where}: the answer {answer!r} must be a choice's index, text or letter")
    if isinstance(answer, str):
        letters = [chr(ord("A") + i) for i in range(n)]
        for names in (labels, choices, letters):  # a label ("2" in ARC) before an index written as text
            if answer in names:
                return names.index(answer)
        if answer.strip().lstrip("-").isdigit():
            answer = int(answer)  # "1": an index written as a string (common in CSV-born files)
    if isinstance(answer, int):
        if not 0 <= answer < n:
            raise DataError(f"{where}: the answer index {answer} is out of range for {n} choices "
                            f"(0..{n - 1})")
        return answer
    raise DataError(f"{where}: the answer {answer!r} names none of the {n} choices; give its index "
                    f"(0..{n - 1}), its text or its letter")
