"""outcore doctor: the probe rendered as a table (warnings in yellow) or as one JSON object."""
from __future__ import annotations

import io
import json
import sys
import types

import pytest
from rich.console import Console

from outcore.errors import SwapDirError
from outcore.cli import main
from outcore.cli.doctor import render

GiB = 1 << 30
FIELDS = ("cpu_threads", "ram_total_bytes", "ram_available_bytes", "devices", "swap_dir", "swap_free_bytes",
          "swap_fs_type", "o_direct", "disk_read_gbps", "disk_write_gbps", "h2d_gbps", "d2h_gbps",
          "backends", "warnings", "leftover_swap_dirs")


def _probe_dict(**kw):
    d = dict(cpu_threads=16, ram_total_bytes=128 * GiB, ram_available_bytes=100 * GiB,
             devices=[{"name": "NVIDIA H100", "total_bytes": 80 * GiB, "free_bytes": 79 * GiB}],
             swap_dir="/nvme/swap", swap_free_bytes=900 * GiB, swap_fs_type="xfs", o_direct=True,
             disk_read_gbps=6.5, disk_write_gbps=5.25, h2d_gbps=24.0, d2h_gbps=25.5,
             backends={"kvikio": None, "triton": "3.2.0", "bitsandbytes": "0.45.0", "deepspeed": None},
             warnings=["swap dir /nvme/swap has only 3.0 GiB free"],
             leftover_swap_dirs=["/nvme/swap/outcore-1234"])
    d.update(kw)
    return d


@pytest.fixture
def fake_probe(monkeypatch):
    """Install a fake outcore.offload.store.probe; returns the list of (swap_dir, measure) calls."""
    calls = []
    data = _probe_dict()

    class FakeProbe:
        def to_dict(self):
            return dict(data)

    def probe_hardware(swap_dir=None, measure=True):
        calls.append((swap_dir, measure))
        if swap_dir == "/locked":
            raise SwapDirError("swap dir '/locked' is locked by another run (pid 42); pass another --swap-dir")
        return FakeProbe()

    module = types.ModuleType("outcore.offload.store.probe")
    module.probe_hardware = probe_hardware
    monkeypatch.setitem(sys.modules, "outcore.offload.store.probe", module)
    return calls


def test_json_is_one_object(fake_probe, capsys):
    assert main(["doctor", "--json", "--no-measure", "--swap-dir", "/nvme/swap"]) == 0
    assert fake_probe == [("/nvme/swap", False)]
    assert json.loads(capsys.readouterr().out) == _probe_dict()


def test_table_shows_every_section(fake_probe, capsys):
    assert main(["doctor"]) == 0
    assert fake_probe == [(None, True)]
    out = capsys.readouterr().out
    for text in ("CPU threads", "16", "128 GiB total, 100 GiB available", "NVIDIA H100, 80.0 GiB total, 79.0 GiB free",
                 "h2d 24.00 GB/s", "d2h 25.50 GB/s", "/nvme/swap", "900 GiB on xfs", "O_DIRECT", "yes",
                 "read 6.50 GB/s", "write 5.25 GB/s", "triton", "3.2.0", "kvikio", "not installed",
                 "/nvme/swap/outcore-1234", "swap dir /nvme/swap has only 3.0 GiB free"):
        assert text in out, text


def test_the_table_names_the_largest_full_finetune_the_disk_holds():
    from outcore.cli.doctor import largest_report

    out = io.StringIO()
    free = 40 * 10**9
    Console(file=out, width=200).print(render(_probe_dict(swap_free_bytes=free), largest=largest_report(free)))
    text = out.getvalue()
    assert "largest: the llama3-8b shape (8.03B parameters" in text and "bf16-lean" in text
    assert "14b needs 55.0 GiB" in text


def test_warnings_are_yellow():
    console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=120)
    console.print(render(_probe_dict()))
    out = console.file.getvalue()
    assert "\x1b[33mswap dir /nvme/swap has only 3.0 GiB free" in out


def test_cpu_only_unmeasured_and_unknown_keys():
    console = Console(file=io.StringIO(), width=120)
    console.print(render(_probe_dict(devices=[], disk_read_gbps=None, disk_write_gbps=None, h2d_gbps=None,
                                     d2h_gbps=None, warnings=[], leftover_swap_dirs=[], o_direct=False,
                                     numa_nodes=2), measured=False))
    out = console.file.getvalue()
    assert "CPU only" in out and "not measured (--no-measure)" in out
    assert "no (reads may hit the page cache)" in out
    assert "numa_nodes" in out and "Leftover" not in out


def test_probe_errors_are_one_line(fake_probe, capsys):
    assert main(["doctor", "--swap-dir", "/locked"]) == 2
    err = capsys.readouterr().err
    assert err == "outcore: error: swap dir '/locked' is locked by another run (pid 42); pass another --swap-dir\n"


def test_real_probe_json(tmp_path, capsys):
    pytest.importorskip("outcore.offload.store.probe")
    assert main(["doctor", "--json", "--no-measure", "--swap-dir", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(FIELDS) <= set(data)
    assert data["swap_dir"] == str(tmp_path) and data["disk_read_gbps"] is None
    assert data["cpu_threads"] >= 1 and data["ram_total_bytes"] > data["ram_available_bytes"] > 0


def test_real_probe_table(tmp_path, capsys):
    pytest.importorskip("outcore.offload.store.probe")
    assert main(["doctor", "--no-measure", "--swap-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Swap directory" in out and "not measured (--no-measure)" in out and "Backends" in out
