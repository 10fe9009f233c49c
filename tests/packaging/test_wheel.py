"""The wheel holds the package `outcore` and nothing top level beside it (docs/architecture.md §1)."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests._helpers import ROOT


@pytest.mark.slow(ci=True)
def test_wheel_contains_only_outcore(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(tmp_path.glob("outcore-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"outcore", next(t for t in top if t.endswith(".dist-info"))}, sorted(top)
    for must in ("outcore/__init__.py", "outcore/offload/engine/engine.py", "outcore/kernels/csrc/adamw8bit_cpu.cpp",
                 "outcore/offload/csrc/simdevice.cpp",
                 "outcore/recipes/notebooks/quickstart.ipynb", "outcore/cli/app.py",
                 "outcore/data/shakespeare_mc.jsonl"):
        assert must in names, must
    assert not any(n.startswith(("outcore/tests/", "outcore/scripts/")) for n in names)


def test_the_gds_extra_is_built_for_the_cuda_torch_ships_with():
    """torch 2.11+'s CUDA wheels are CUDA 13 builds: kvikio must be the cu13 one."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert extras["project"]["optional-dependencies"]["gds"] == ["kvikio-cu13"]
