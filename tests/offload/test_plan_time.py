"""The plan's step estimate: the bytes it expects a step to move are what the engine moves,
and its arithmetic (made-up bandwidths, checked by hand)."""
from __future__ import annotations

import pytest
import torch

from outcore.offload.handle import Tier
from outcore.offload.plan import Budgets
from outcore.offload.plan_layout import Layout, Workload, step_time
from outcore.offload.plan_sizes import method_traits, model_spec, unit_bytes
from outcore.offload.training import offload_model
from outcore.optim import AdamW

GiB = 1 << 30
#: round made-up speeds: 2 GB/s read, 1 GB/s write, 10 GB/s copies and RAM, 1e10 FLOP/s
SPEEDS = Budgets(device_bytes=64 * GiB, host_bytes=64 * GiB, nvme_bytes=1 << 40, ram_bytes=64 * GiB,
                 disk_read_gbps=2.0, disk_write_gbps=1.0, h2d_gbps=10.0, d2h_gbps=10.0, host_mem_gbps=10.0,
                 flops=1e10, measured=True)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _planned_io(model, k: int) -> dict[str, int]:
    """The plan's bytes per link for ``model`` all on NVMe, fp32 AdamW, prefetching ``k`` units."""
    spec = model_spec(model)
    units = tuple(unit_bytes(spec, method="full", optim="adamw", dtype="float32"))
    w = Workload(spec, units, method_traits("full"), "float32", 16, False, SPEEDS)
    return step_time(w, Layout.uniform(len(units), Tier.NVME, "keep", prefetch=k), 1).io_bytes


@pytest.mark.parametrize("k,tie", [(1, True), (2, True), (1, False)])
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
        for _ in range(3):  # the first step starts from nothing resident: steady from the second
            before = om.store.tier_stats()["NVME"]
            om.train_step(_loss, [torch.randint(0, 512, (1, 16), generator=g)], 1e-3)
            om.mem.flush()
            after = om.store.tier_stats()["NVME"]
            moved.append((after.read_bytes - before.read_bytes, after.written_bytes - before.written_bytes))
    finally:
        om.close()
    n = len(om.units)
    slack = 4 * n * (4096 + 64 * 9)  # each handle's extent is aligned up to 4 KiB, each tensor to 64 B
    for read, written in moved[1:]:
        assert abs(read - io["nvme_read"]) <= slack, (read, io["nvme_read"])
        assert abs(written - io["nvme_write"]) <= slack, (written, io["nvme_write"])
    assert block > 2 * slack  # a block read more or less than planned would show
