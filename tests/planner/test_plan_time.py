"""The plan's step estimate: the bytes it expects a step to move are what the engine moves,
and its arithmetic (made-up bandwidths, checked by hand)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from outcore.offload.engine import offload_model
from outcore.offload.store import Tier
from outcore.optim import AdamW
from outcore.planner import Budgets, make_plan
from outcore.planner.layout import Layout, Workload, step_time
from outcore.planner.sizes import method_traits, model_spec, unit_bytes
from tests._helpers import causal_lm_loss

GiB = 1 << 30
#: round made-up speeds: 2 GB/s read, 1 GB/s write, 10 GB/s copies and RAM, 1e10 FLOP/s
SPEEDS = Budgets(device_bytes=64 * GiB, host_bytes=64 * GiB, nvme_bytes=1 << 40, ram_bytes=64 * GiB,
                 disk_read_gbps=2.0, disk_write_gbps=1.0, h2d_gbps=10.0, d2h_gbps=10.0, host_mem_gbps=10.0,
                 flops=1e10, measured=True)


def _planned_io(model, k: int) -> dict[str, int]:
    """The plan's bytes per link for ``model`` all on NVMe, fp32 AdamW, prefetching ``k`` units."""
    spec = model_spec(model)
    units = tuple(unit_bytes(spec, method="full", optim="adamw", dtype="float32"))
    w = Workload(spec, units, method_traits("full"), "float32", 16, False, SPEEDS)
    return step_time(w, Layout.uniform(len(units), Tier.NVME, "keep", prefetch=k), 1).io_bytes


@pytest.mark.slow(ci=True)  # two short NVMe runs: the check that the estimate's bytes are the engine's
@pytest.mark.parametrize("k,tie", [(1, True), (2, False)])
def test_planned_nvme_bytes_are_what_a_steady_step_moves(tiny_llama_factory, tmp_path, k, tie):
    """Per step, the store reads and writes what the plan counts (up to each transfer's 4 KiB
    alignment): weights kept between passes are not read again."""
    model = tiny_llama_factory(layers=6, hidden=128, vocab=512, intermediate=512, tie=tie)
    io = _planned_io(model, k)
    block = max(u.weights for u in unit_bytes(model_spec(model), method="full", optim="adamw", dtype="float32"))
    om = offload_model(model, AdamW(model.parameters(), lr=1e-3), offload="nvme", swap_dir=tmp_path / "swap",
                       prefetch=k)
    try:
        g = torch.Generator().manual_seed(0)
        moved = []
        for _ in range(4):  # the first step starts from nothing resident: steady from the second
            before = om.store.tier_stats()["NVME"]
            om.train_step(causal_lm_loss, [torch.randint(0, 512, (1, 16), generator=g)], 1e-3)
            om.mem.flush()
            after = om.store.tier_stats()["NVME"]
            moved.append((after.read_bytes - before.read_bytes, after.written_bytes - before.written_bytes))
    finally:
        om.close()
    n = len(om.units)
    slack = 4 * n * (4096 + 64 * 9)  # each handle's extent is aligned up to 4 KiB, each tensor to 64 B
    for _, written in moved[1:]:
        assert abs(written - io["nvme_write"]) <= slack, (written, io["nvme_write"])
    # Reads: the steadiest step. Units kept for the next pass are a wish, evicted when a fetch
    # needs room while a write-back still holds another one (timing: seen once under load,
    # +345 kB); a plan that counted wrongly would miss in every step.
    read = min(r for r, _ in moved[1:])
    assert abs(read - io["nvme_read"]) <= slack, (moved, io["nvme_read"])
    assert block > 2 * slack  # a block read more or less than planned would show


def _workload(model, budgets: Budgets, dtype: str = "float32") -> Workload:
    spec = model_spec(model)
    units = tuple(unit_bytes(spec, method="full", optim="adamw", dtype=dtype))
    return Workload(spec, units, method_traits("full"), dtype, 16, False, budgets)


def test_cpu_step_is_the_longer_of_the_cores_work_and_the_disks(tiny_llama_factory):
    """CPU-only: compute, update, copies and checksums share the cores (they add up); the disk
    serves reads and writes in turn (they add up); the step is the longer, nothing before it
    (the first units are kept from the step before)."""
    model = tiny_llama_factory(layers=6, hidden=128, vocab=512, intermediate=512)
    fast = dataclasses.replace(SPEEDS, checksum_gbps=4.0)
    w = _workload(model, fast)
    t = step_time(w, Layout.uniform(len(w.units), Tier.NVME, "keep", prefetch=2), 1)
    io = t.io_bytes
    disk = io["nvme_read"] / 2e9 + io["nvme_write"] / 1e9
    hashing = (io["nvme_read"] + io["nvme_write"]) / 4e9
    assert t.io_s["nvme_read"] + t.io_s["nvme_write"] == pytest.approx(disk)
    assert t.step_s == pytest.approx(max(t.compute_s + t.update_s + hashing, disk))
    slow = step_time(_workload(model, dataclasses.replace(fast, disk_read_gbps=0.01, disk_write_gbps=0.01)),
                     Layout.uniform(len(w.units), Tier.NVME, "keep", prefetch=2), 1)
    assert slow.step_s == pytest.approx((io["nvme_read"] + io["nvme_write"]) / 1e7)  # disk-bound: the disk alone
    assert slow.exposed_io_s == pytest.approx(slow.step_s - slow.compute_s - slow.update_s)
    host = step_time(w, Layout.uniform(len(w.units), Tier.HOST, "keep", prefetch=2), 1)
    copy = host.io_bytes["h2d"] / 10e9
    assert host.io_bytes["h2d"] > 0 and host.io_bytes["nvme_read"] == 0
    assert host.step_s == pytest.approx(host.compute_s + host.update_s + copy)


def test_cuda_step_overlaps_compute_disk_copies_and_the_host_side(tiny_llama_factory):
    model = tiny_llama_factory(layers=6, hidden=128, vocab=512, intermediate=512)
    gpu = dataclasses.replace(SPEEDS, device_kind="cuda", checksum_gbps=4.0, flops=1e14)
    w = _workload(model, gpu)
    t = step_time(w, Layout.uniform(len(w.units), Tier.NVME, "keep", prefetch=2), 1)
    io = t.io_bytes
    lanes = [t.compute_s, io["nvme_read"] / 2e9 + io["nvme_write"] / 1e9, (io["h2d"] + io["d2h"]) / 10e9,
             t.update_s + (io["nvme_read"] + io["nvme_write"]) / 4e9]
    assert t.step_s == pytest.approx(max(lanes))


def test_mixed_precision_update_counts_the_widening_and_the_rounding(tiny_llama_factory):
    """bf16 with fp32 masters: per trainable element the update reads and writes 2 + 2 (weight),
    2 (grad), 2 x 12 (master + two moments), and widens (2 + 4, read again: + 2) and rounds (4 + 2)."""
    model = tiny_llama_factory(layers=2, hidden=64, vocab=256, intermediate=128)
    w32, w16 = _workload(model, SPEEDS), _workload(model, SPEEDS, "bfloat16")
    lay = Layout.uniform(len(w32.units), Tier.NVME, "keep", prefetch=1)
    n = sum(u.trainable for u in w32.units)
    t32, t16 = step_time(w32, lay, 1), step_time(w16, lay, 1)
    steps = sum(u.state for u in w32.units) - 8 * n  # the fp32 step counts, one per tensor
    assert t32.update_s == pytest.approx((4 * 2 * n + 4 * n + 2 * (8 * n + steps)) / 10e9)
    assert t16.update_s == pytest.approx((2 * 2 * n + 2 * n + 2 * (12 * n + steps) + 14 * n) / 10e9)


def test_lean_update_counts_no_master(tiny_llama_factory):
    """bf16-lean keeps no fp32 master: its update reads and writes the bf16 weight, reads the
    gradient and the state, writes the state, and nothing more (no widening or rounding pass in
    RAM)."""
    model = tiny_llama_factory(layers=2, hidden=64, vocab=256, intermediate=128)
    spec = model_spec(model)
    units = tuple(unit_bytes(spec, method="full", optim="adamw8bit", dtype="bfloat16", precision="bf16-lean"))
    w = Workload(spec, units, method_traits("full"), "bfloat16", 16, False, SPEEDS, masters=False)
    t = step_time(w, Layout.uniform(len(units), Tier.NVME, "keep", prefetch=1), 1)
    assert t.update_s == pytest.approx(sum(2 * u.weights + u.grads + 2 * u.state for u in units) / 10e9)
    plan = make_plan(model, optim="adamw8bit", dtype="bfloat16", precision="bf16-lean", offload="nvme",
                     budgets=SPEEDS)
    assert plan.time.update_s == pytest.approx(t.update_s)  # the plan builds its workload so


def test_a_timed_update_is_its_rate_plus_a_masters_bytes(tiny_llama_factory):
    model = tiny_llama_factory(layers=2, hidden=64, vocab=256, intermediate=128)
    lay = Layout.uniform(len(_workload(model, SPEEDS).units), Tier.NVME, "keep", prefetch=1)
    for dtype, master in (("float32", 0), ("bfloat16", 14)):
        w = dataclasses.replace(_workload(model, SPEEDS, dtype), update_params_per_s=1e8)
        n = sum(u.trainable for u in w.units)
        assert step_time(w, lay, 1).update_s == pytest.approx(n / 1e8 + master * n / 10e9)


def test_the_checksum_rate_comes_from_the_probe():
    from types import SimpleNamespace

    from outcore.planner.budget import FALLBACK_CHECKSUM_GBPS, budgets_from_probe

    probe = SimpleNamespace(ram_available_bytes=8 * GiB, swap_free_bytes=GiB, disk_read_gbps=2.0,
                            disk_write_gbps=1.0, h2d_gbps=5.0, d2h_gbps=5.0, checksum_gbps=3.5)
    assert budgets_from_probe(probe).checksum_gbps == 3.5
    probe.checksum_gbps = None  # not measured
    assert budgets_from_probe(probe).checksum_gbps == FALLBACK_CHECKSUM_GBPS
