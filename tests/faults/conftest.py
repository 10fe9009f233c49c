"""Fixtures of the fault trials and the fuzzing: the harness's helpers and its tiny inputs."""
from __future__ import annotations

import contextlib
import importlib
import io
import re
import sys

import pytest

from tests._helpers import ROOT

SCRIPTS = ROOT / "scripts"
PROGRESS = re.compile(r"\d+%\|.*\|")  # a tqdm bar: " 50%|#####     | 10/20 [...]"


def trial_module(name: str):
    """A module of ``scripts/`` (trial_faults and its helpers import each other by name)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


@pytest.fixture(scope="session")
def trial_inputs(tmp_path_factory):
    """The harness's tiny Llama (320-token BPE tokenizer) and text, built once."""
    return trial_module("_trial_run").build_inputs(tmp_path_factory.mktemp("trial_inputs"))


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``outcore ARGV`` in this process: (exit code, stderr). Any exception but SystemExit
    escapes, so a traceback the user would see fails the test."""
    from outcore.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


def assert_user_error(rc: int, err: str, *names: str) -> None:
    """Exit code 2 and one line ``outcore: error: ...`` (naming ``names``), never a traceback.
    (Progress bars that libraries draw on stderr, e.g. transformers' "Loading weights", are
    not lines of ours and are left out.)"""
    lines = [ln for ln in re.split(r"[\r\n]", err) if ln.strip() and not PROGRESS.search(ln)]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("outcore: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
