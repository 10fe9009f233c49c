"""The hardware probe (what ``outcore doctor`` prints)."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil

from outcore.offload.store import probe as probe_mod
from outcore.offload.store import LOCK_NAME, SwapDir
from outcore.offload.store.probe import HardwareProbe, fs_type, probe_hardware


def test_probe_without_measuring(tmp_path):
    p = probe_hardware(tmp_path, measure=False)
    assert isinstance(p, HardwareProbe)
    assert p.cpu_threads >= 1
    assert p.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < p.ram_available_bytes <= p.ram_total_bytes
    assert p.swap_dir == str(tmp_path)
    assert p.swap_free_bytes > 0
    assert p.swap_fs_type == fs_type(tmp_path) != ""
    assert p.disk_read_gbps is None and p.disk_write_gbps is None
    assert p.h2d_gbps is None and p.d2h_gbps is None
    assert set(p.backends) == {"kvikio", "triton", "bitsandbytes", "deepspeed"}
    json.dumps(p.to_dict())  # JSON-able as is


def test_probe_measures_with_the_engine(tmp_path):
    p = probe_hardware(tmp_path / "not-yet", measure=True, seconds=0.4)
    assert p.disk_read_gbps > 0 and p.disk_write_gbps > 0
    assert p.h2d_gbps > 0 and p.d2h_gbps > 0
    assert p.checksum_gbps > 0  # the extent checksum every NVMe byte costs the CPU
    assert list(tmp_path.iterdir()) == []  # the measurement file is gone
    assert probe_hardware(tmp_path, measure=False).checksum_gbps is None


def test_probe_lists_leftover_swap_dirs_but_not_live_ones(tmp_path):
    dead = tmp_path / "run-dead"
    # A real process takes the swap dir and dies without cleaning up.
    code = (f"import os; from outcore.offload.store.swapdir import SwapDir; "
            f"SwapDir({str(dead)!r}); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (dead / LOCK_NAME).exists()
    with SwapDir(tmp_path / "run-live"):
        p = probe_hardware(tmp_path, measure=False)
    assert p.leftover_swap_dirs == [str(dead)]
    assert any("leftover" in w and str(dead) in w for w in p.warnings)


def test_probe_warns_about_foreign_kernels_package(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_mod, "foreign_kernels_package", lambda: "/site-packages/kernels/__init__.py")
    p = probe_hardware(tmp_path, measure=False)
    assert any("'kernels'" in w and "/site-packages/kernels" in w for w in p.warnings)


def test_probe_warns_about_memory_fs_and_no_odirect(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_mod, "fs_type", lambda path: "tmpfs")
    monkeypatch.setattr(probe_mod, "supports_o_direct", lambda d: False)
    p = probe_hardware(tmp_path, measure=False)
    assert p.swap_fs_type == "tmpfs" and p.o_direct is False
    assert any("tmpfs" in w for w in p.warnings)
    assert any("O_DIRECT" in w for w in p.warnings)


def test_probe_warns_about_little_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_mod, "LOW_FREE_BYTES", 1 << 62)
    p = probe_hardware(tmp_path, measure=False)
    assert any("GiB free" in w for w in p.warnings)
