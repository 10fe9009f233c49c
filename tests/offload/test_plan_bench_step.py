"""scripts/bench_step.py: the peer's config, the measurement helpers, the JSON contract."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_step.py"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load(SCRIPT)


@pytest.fixture(scope="module")
def peer():
    return _load(SCRIPT.parent / "_deepspeed_peer.py")


HYPER = dict(lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def test_deepspeed_config_is_the_documented_one(peer):
    cfg = peer.deepspeed_config("nvme", "/swap", batch=2, **HYPER)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["stage3_param_persistence_threshold"] == 0 and z["sub_group_size"] == 10**8
    assert z["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/swap",
                                  "buffer_count": 5, "buffer_size": 10**8, "max_in_cpu": 10**9}
    assert z["offload_optimizer"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/swap"}
    assert cfg["aio"] == {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1,
                          "single_submit": False, "overlap_events": True}
    assert cfg["optimizer"]["type"] == "AdamW"
    assert not cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    cpu = peer.deepspeed_config("cpu", "/swap", batch=2, **HYPER)["zero_optimization"]
    assert cpu["offload_param"] == {"device": "cpu", "pin_memory": False}
    with pytest.raises(ValueError, match="device='disk'"):
        peer.deepspeed_config("disk", "/swap", batch=2, **HYPER)


def test_time_steps_reports_median_min_max_and_io(bench):
    calls = []

    def step(b):
        calls.append(b)
        return float(b)

    r = bench.time_steps(step, list(range(7)), warmup=2)
    assert calls == list(range(7))
    assert r["losses"] == [float(i) for i in range(7)]
    assert len(r["step_times_s"]) == 5
    assert r["min_step_s"] <= r["median_step_s"] <= r["max_step_s"]
    assert r["bytes_read_per_step"] >= 0 and r["bytes_written_per_step"] >= 0


def test_parse_args_quick_and_bad_mode(bench):
    a = bench.parse_args(["--quick"])
    assert (a.model, a.seq, a.batch, a.steps) == ("tiny", 64, 1, 5)
    assert a.modes == list(bench.MODES)
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "in_memory,warp_drive"])


def test_ratio_needs_two_measured_modes(bench):
    ok = {"status": "ok", "median_step_s": 2.0}
    assert bench._ratio(ok, {"status": "ok", "median_step_s": 1.0}) == 2.0
    assert bench._ratio(ok, {"status": "unavailable"}) is None


@pytest.mark.slow
def test_quick_run_prints_the_json_contract(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", "--modes", "in_memory,outcore_nvme",
                          "--swap-dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for mode in ("in_memory", "outcore_nvme", "outcore_host", "deepspeed_nvme", "deepspeed_cpu"):
        assert mode in r
    m = r["in_memory"]
    assert m["status"] == "ok" and m["median_step_s"] > 0 and m["peak_rss_bytes"] > 0
    assert {"bytes_read_per_step", "bytes_written_per_step", "losses"} <= set(m)
    assert "ratio_outcore_nvme_vs_in_memory" in r and "ratio_deepspeed_nvme_vs_outcore_nvme" in r
    assert r["outcore_nvme"]["status"] in ("ok", "unavailable")
