"""The import contracts of pyproject.toml ([tool.importlinter], docs/architecture.md §1) hold on
the tree, and each of them fails on a copy of it given one import against it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[2]  # the package outcore
# the package's code and its config; none of tests/, scripts/, docs/, notebooks or kernel sources
_NOT_CODE = shutil.ignore_patterns(".*", "__pycache__", "tests", "scripts", "docs", "notebooks", "csrc",
                                   "build", "dist", "*.egg-info", "*.md", "*.jsonl")


def _lint_imports(tree: Path, parent: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on ``tree`` (a directory that is the package outcore), found through ``parent``."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": str(parent)}
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def _link(tmp_path: Path) -> Path:
    """A directory in which ``outcore`` is this tree (as an installed package is found)."""
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "outcore").symlink_to(ROOT, target_is_directory=True)
    return tmp_path / "path"


def test_the_tree_keeps_every_contract(tmp_path):
    done = _lint_imports(ROOT, _link(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


# (module, the line added to it, the contract it breaks)
UPWARD = [
    ("kernels/quantize.py", "from ..tui import plain", "Each layer of outcore imports only the layers below it"),
    ("training/loss.py", "from ..recipes import generate", "Each layer of outcore imports only the layers below it"),
    ("offload/store/handle.py", "from ..engine import units",
     "Inside offload each subsystem imports only those before it"),
    ("methods.py", "import torch", "The lists of names read before torch loads"),
]


@pytest.mark.parametrize("module,line,contract", UPWARD, ids=[m for m, _, _ in UPWARD])
def test_an_import_against_a_contract_breaks_it(tmp_path, module, line, contract):
    tree = tmp_path / "outcore"
    shutil.copytree(ROOT, tree, ignore=_NOT_CODE)
    with open(tree / module, "a") as f:
        f.write(f"\n{line}  # deliberately against the contract\n")
    done = _lint_imports(tree, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    broken = done.stdout.partition("Broken contracts")[2]
    assert contract in broken and "1 broken" in done.stdout, done.stdout
