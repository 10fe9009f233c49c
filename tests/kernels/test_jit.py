"""A killed build's lock file does not hang the next load (kernels/_jit.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# A trivial library (no torch headers: compiles in about a second), loaded as a plain .so.
_SRC = 'extern "C" int outcore_jit_probe() { return 7; }\n'


def _load_in_subprocess(tmp_path, call: str, timeout: float):
    src = tmp_path / "probe.cpp"
    src.write_text(_SRC)
    code = textwrap.dedent(f"""
        from torch.utils import cpp_extension
        from outcore.kernels._jit import load_extension
        {call}(name="outcore_jit_probe", sources=[{str(src)!r}], is_python_module=False, verbose=False)
        print("loaded")
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture
def stale_lock(tmp_path, monkeypatch):
    """The build directory of the probe with the file a builder killed by SIGKILL leaves."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    build = Path(cpp_extension._get_build_directory("outcore_jit_probe", verbose=False))
    (build / "lock").write_text("")
    return build


def test_a_stale_lock_is_removed_and_the_build_goes_on(tmp_path, stale_lock):
    res = _load_in_subprocess(tmp_path, "load_extension", timeout=120)
    assert res.returncode == 0 and "loaded" in res.stdout, res.stderr[-2000:]
    assert not (stale_lock / "lock").exists()


def test_torch_alone_waits_on_a_stale_lock(tmp_path, stale_lock):
    """The control: without the guard, torch's load waits on the dead builder's file."""
    with pytest.raises(subprocess.TimeoutExpired):
        _load_in_subprocess(tmp_path, "cpp_extension.load", timeout=8)
