"""What the kernel tests share."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture
def run_in_triton_interpreter():
    """``run(script) -> CompletedProcess``: ``python -c script`` with ``TRITON_INTERPRET=1``.

    Triton picks interpreter vs compiler when ``@triton.jit`` runs (at the kernel module's
    import), so a Triton kernel is checked on the CPU in a fresh process with the variable set;
    this process's other tests are not affected.
    """
    def run(script: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    return run
