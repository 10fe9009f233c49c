"""scripts/bench_step.py: the peer's config, the measurement helpers, the JSON contract."""
from __future__ import annotations

import json
import mmap
import subprocess
import sys

import pytest
import torch

from tests._helpers import ROOT, load_module

SCRIPT = ROOT / "scripts" / "bench_step.py"


@pytest.fixture(scope="module")
def bench():
    return load_module(SCRIPT)


@pytest.fixture(scope="module")
def peer():
    return load_module(SCRIPT.parent / "_deepspeed_peer.py")


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
    assert a.modes == list(bench.MODES) and "outcore_nvme_8bit" in a.modes
    assert a.activations == "keep"  # the recipe's default
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "in_memory,warp_drive"])


def test_ratio_needs_two_measured_modes(bench):
    ok = {"status": "ok", "median_step_s": 2.0}
    assert bench._ratio(ok, {"status": "ok", "median_step_s": 1.0}) == 2.0
    assert bench._ratio(ok, {"status": "unavailable"}) is None


def test_add_ratios_names_every_comparison(bench):
    def mode(t, rss, written, losses):
        return {"status": "ok", "median_step_s": t, "peak_rss_bytes": rss, "bytes_written_per_step": written,
                "losses": losses}
    r = {m: {"status": "skipped"} for m in bench.MODES}
    r["in_memory"] = mode(2.0, 3000, 0, [4.0, 3.5])
    r["outcore_nvme"] = mode(2.5, 1000, 400, [4.0, 3.25])
    r["deepspeed_nvme"] = mode(5.0, 7000, 1600, [4.0, 3.5])
    bench.add_ratios(r)
    assert r["ratio_outcore_nvme_vs_in_memory"] == 1.25 and r["ratio_deepspeed_nvme_vs_outcore_nvme"] == 2.0
    assert r["ratio_rss_outcore_nvme_vs_in_memory"] == pytest.approx(1 / 3)
    assert r["ratio_written_outcore_nvme_vs_deepspeed_nvme"] == 0.25
    assert r["ratio_written_outcore_nvme_8bit_vs_deepspeed_nvme"] is None  # not measured: no figure
    gaps = r["loss_max_abs_diff_vs_in_memory"]
    assert gaps["outcore_nvme"] == 0.25 and gaps["deepspeed_nvme"] == 0.0 and gaps["outcore_host"] is None
    assert "AdamW8bit" in r["loss_note"]


def test_rss_trace_records_each_phase(bench):
    trace = bench.RssTrace(interval=0.001)
    trace.mark("work")
    # fresh anonymous pages, each touched: 32 MiB more resident (a heap allocation could
    # reuse pages an earlier test freed, and RSS would not grow)
    blob = mmap.mmap(-1, 32 << 20)
    for offset in range(0, 32 << 20, mmap.PAGESIZE):
        blob[offset] = 1
    trace.mark("after")
    blob.close()
    phases = trace.stop()
    assert list(phases) == ["imports", "work", "after"]
    work = phases["work"]
    assert work["end_bytes"] >= phases["imports"]["end_bytes"] + (30 << 20)
    assert work["peak_bytes"] >= work["end_bytes"]
    assert work["end_anon_bytes"] + work["end_file_bytes"] <= work["end_bytes"] + (1 << 20)


def test_random_weights_are_the_same_whole_or_unit_by_unit(bench):
    from _bench_outcore import full_model, lazy_model, random_fill

    cfg = bench.model_config("tiny")
    whole = full_model("tiny", cfg, seed=3)
    lazy, fill = lazy_model("tiny", bench.model_config("tiny"), seed=3)
    assert all(p.is_meta for p in lazy.parameters())
    assert whole.lm_head.weight is whole.model.embed_tokens.weight  # tied, filled once
    for name, p in whole.named_parameters():
        out = torch.empty(p.shape)
        fill(name, out)  # any order, any process: a function of (seed, name)
        assert torch.equal(out, p.detach()), name
    other = torch.empty(whole.model.norm.weight.shape)
    random_fill(3)("model.norm.weight", other)
    assert torch.equal(other, torch.ones_like(other))
    a, b = torch.empty(512, 128), torch.empty(512, 128)
    random_fill(3)("model.layers.0.mlp.up_proj.weight", a)
    random_fill(4)("model.layers.0.mlp.up_proj.weight", b)
    assert not torch.equal(a, b)


@pytest.mark.slow(ci=True)
def test_outcore_trainer_matches_in_memory_training(bench, tmp_path):
    """The product path (lazy model, recipe builders, chunked loss, NVMe) trains like torch AdamW
    on the full model with HF's loss: same losses up to the chunked loss's rounding."""
    from _bench_outcore import OutcoreTrainer, full_model

    torch.manual_seed(0)
    cfg = bench.model_config("tiny")
    batches = [torch.randint(0, cfg.vocab_size, (1, 32)) for _ in range(3)]
    model = full_model("tiny", cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **bench.HYPER)
    ref = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss.detach()))
    trainer = OutcoreTrainer("tiny", bench.model_config("tiny"), 0, offload="nvme", optim="adamw", seq_len=32,
                             batch_size=1, hyper=bench.HYPER, work_dir=str(tmp_path))
    try:
        got = [trainer.step(ids) for ids in batches]
        tiers = trainer.tier_stats()
    finally:
        trainer.close()
    assert got == pytest.approx(ref, abs=1e-5)
    assert tiers["NVME"]["written_bytes"] > 0 and tiers["NVME"]["read_bytes"] > 0
    assert not any(tmp_path.iterdir())  # the swap directory is gone


@pytest.mark.slow
def test_quick_run_prints_the_json_contract(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", "--modes", "in_memory,outcore_nvme",
                          "--swap-dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for mode in ("in_memory", "outcore_nvme", "outcore_nvme_8bit", "outcore_host", "deepspeed_nvme",
                 "deepspeed_cpu"):
        assert mode in r
    m = r["in_memory"]
    assert m["status"] == "ok" and m["median_step_s"] > 0 and m["peak_rss_bytes"] > 0
    assert {"bytes_read_per_step", "bytes_written_per_step", "losses"} <= set(m)
    for key in ("ratio_outcore_nvme_vs_in_memory", "ratio_deepspeed_nvme_vs_outcore_nvme",
                "ratio_written_outcore_nvme_vs_deepspeed_nvme", "ratio_written_outcore_nvme_8bit_vs_deepspeed_nvme",
                "ratio_rss_outcore_nvme_vs_in_memory"):
        assert key in r
    o = r["outcore_nvme"]
    assert o["status"] == "ok" and o["bytes_written_per_step"] > 0
    assert o["losses"] == pytest.approx(m["losses"], abs=1e-5)  # the same job as the baseline
    assert set(o["rss_trace"]) == {"imports", "setup", "train", "finish"}


def test_outcore_trainer_that_cannot_be_built_leaves_no_files(bench, tmp_path):
    from _bench_outcore import OutcoreTrainer

    from outcore.errors import ConfigError
    with pytest.raises(ConfigError, match="optim='sgd'"):
        OutcoreTrainer("tiny", bench.model_config("tiny"), 0, offload="nvme", optim="sgd", seq_len=32,
                       batch_size=1, hyper=bench.HYPER, work_dir=str(tmp_path))
    assert not any(tmp_path.iterdir())
