"""Task files: the accepted shapes, and one-line errors for bad ones."""
from __future__ import annotations

import json

import pytest

from outcore.data.tasks import BUILTIN_TASKS, load_task
from outcore.errors import DataError


def _write(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def test_accepted_shapes(tmp_path):
    p = _write(tmp_path, [
        {"query": "q0", "choices": ["a", "b"], "gold": 1},
        {"question": "q1", "choices": ["x", "y", "z"], "answer": "z"},  # the answer's text
        {"question": "q2", "choices": {"text": ["p", "q"], "label": ["1", "2"]}, "answerKey": "2"},  # ARC
        {"ctx": "q3", "endings": ["e", "f", "g"], "label": "B"},  # a letter
        {"context": "q4", "options": ["no", "yes"], "label": "0"},  # an index written as a string
    ])
    task = load_task(p)
    assert task.name == "t" and [i.gold for i in task.items] == [1, 2, 1, 1, 0]
    assert task.items[2].choices == ("p", "q") and task.items[3].query == "q3"
    assert len(load_task(p, limit=2).items) == 2


def test_shipped_shakespeare_task():
    task = load_task("shakespeare")
    assert task.path == BUILTIN_TASKS["shakespeare"] and len(task.items) == 40
    assert {i.gold for i in task.items} == {0, 1, 2, 3}  # the right answer is not always in one place
    assert all(len(i.choices) == 4 for i in task.items)


@pytest.mark.parametrize("rows, message", [
    ([{"choices": ["a", "b"], "gold": 0}], "no the query"),
    ([{"query": "q", "gold": 0}], "no the choices"),
    ([{"query": "q", "choices": ["a", "b"]}], "no the answer"),
    ([{"query": "q", "choices": ["a", "b"], "gold": 2}], "answer index 2 is out of range for 2 choices"),
    ([{"query": "q", "choices": ["a", "b"], "gold": -1}], "out of range"),
    ([{"query": "q", "choices": ["a", "b"], "answer": "c"}], "names none of the 2 choices"),
    ([{"query": "q", "choices": ["a"], "gold": 0}], "at least two non-empty strings"),
    ([{"query": 3, "choices": ["a", "b"], "gold": 0}], "the query must be a string"),
    (["{not json"], "not valid JSON"),
    ([], "has no example"),
])
def test_bad_task_files_are_one_line_errors(tmp_path, rows, message):
    p = _write(tmp_path, rows)
    with pytest.raises(DataError) as err:
        load_task(p)
    text = str(err.value)
    assert message in text and "\n" not in text
    assert str(p) in text  # names the file (and the line where there is one)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_task(tmp_path / "nope.jsonl")
