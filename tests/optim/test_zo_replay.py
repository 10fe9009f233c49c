"""The ZO run log: each line checksummed; a torn or damaged tail is dropped and said."""
from __future__ import annotations

import json

import pytest

from outcore.errors import CheckpointError
from outcore.optim.zo_core import StepRecord
from outcore.optim.zo_replay import LOG_NAME, ZOLog, ZOLogWriter


def _write(tmp_path, steps=3):
    w = ZOLogWriter(tmp_path, {"schedule": "exact", "params": []})
    for i in range(1, steps + 1):
        w.append(StepRecord(step=i, seeds=[i], grads=[0.5 * i], lr=1e-3, loss=2.0))
    w.close()
    return tmp_path / LOG_NAME


def test_a_whole_log_loads_with_nothing_damaged(tmp_path):
    log = ZOLog.load(_write(tmp_path))
    assert [r.step for r in log.records] == [1, 2, 3] and log.damaged is None


def test_a_torn_last_line_is_dropped_and_said(tmp_path):
    path = _write(tmp_path)
    path.write_text(path.read_text()[:-9])  # a kill mid-write
    log = ZOLog.load(path)
    assert [r.step for r in log.records] == [1, 2] and "line 4 is damaged" in log.damaged


def test_a_flipped_value_in_the_middle_keeps_the_steps_before_it(tmp_path):
    path = _write(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace('"grads": [1.0]', '"grads": [1.5]')  # still valid JSON
    path.write_text("".join(lines))
    log = ZOLog.load(path)
    assert [r.step for r in log.records] == [1] and "line 3 is damaged (checksum mismatch)" in log.damaged


def test_a_damaged_header_is_refused(tmp_path):
    path = _write(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace('"exact"', '"exacT"')
    path.write_text("".join(lines))
    with pytest.raises(CheckpointError, match="malformed \\(checksum mismatch\\)"):
        ZOLog.load(path)


def test_a_log_written_before_checksums_still_loads(tmp_path):
    lines = [json.dumps({"format": json.loads(_write(tmp_path).read_text().splitlines()[0])["format"],
                         "header": {"schedule": "exact", "params": []}}),
             json.dumps(StepRecord(step=1, seeds=[1], grads=[0.5], lr=1e-3, loss=2.0).to_json())]
    (tmp_path / "old.jsonl").write_text("\n".join(lines) + "\n")
    log = ZOLog.load(tmp_path / "old.jsonl")
    assert [r.step for r in log.records] == [1] and log.damaged is None
