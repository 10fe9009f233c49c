"""The recipe's swap file: the plan's NVMe figure reserved before the units are written, then
trimmed to the units' extents plus the room of gradients spilled to NVMe (docs/architecture.md §3)."""
from __future__ import annotations

import pytest
import torch

from outcore.models import load_model
from outcore.optim import build_optimizer, with_precision
from outcore.planner import Budgets, plan_for_config
from outcore.training.build import offload_from_plan
from outcore.training.config import load_config

GiB = 1 << 30


@pytest.mark.parametrize("clip,grads_in_ram", [(0.0, False), (1.0, True), (1.0, False)])
def test_the_swap_file_holds_the_units_and_the_spilled_gradients(tiny_run_inputs, tmp_path, clip, grads_in_ram):
    cfg = load_config(overrides=dict(model=str(tiny_run_inputs / "model"), offload="nvme", seq_len=16,
                                     batch_size=1, max_grad_norm=clip, precision="bf16-lean",
                                     optim="adamw8bit", output=str(tmp_path / "run")))
    model, _ = load_model(cfg.model, dtype=torch.bfloat16)
    model.config.use_cache = False
    budgets = Budgets(device_bytes=GiB, host_bytes=GiB, nvme_bytes=1 << 40, ram_bytes=4 * GiB)
    plan = plan_for_config(cfg, model, budgets=budgets)
    if clip and not grads_in_ram:  # a HOST budget too small for the gradients: they go to NVMe
        tight = plan.tier_total("HOST") // 2
        plan = plan_for_config(cfg, model, budgets=Budgets(device_bytes=GiB, host_bytes=tight,
                                                           nvme_bytes=1 << 40, ram_bytes=4 * GiB))
    nvme_plan = plan.tier_bytes["NVME"]
    # clipping keeps every unit's gradient: in HOST where it holds them, else on NVMe
    assert bool(nvme_plan.get("grads")) == (clip > 0 and not grads_in_ram)
    assert bool(plan.tier_bytes["HOST"].get("grads")) == grads_in_ram
    opt = with_precision(build_optimizer(cfg.optim, model.parameters(), lr=1e-3), cfg.precision, seed=0)
    (tmp_path / "run").mkdir()
    om = offload_from_plan(cfg, model.train(), opt, plan, tmp_path / "run")
    try:
        nvme = om.store.nvme
        kept = nvme.capacity - nvme.held
        assert om.spill == (clip > 0)
        if nvme_plan.get("grads"):  # the gradients' room (and the plan's padding bound) stays reserved ...
            assert kept >= nvme_plan["grads"]
        else:  # ... without them the file is the units' extents: 4 B per parameter in this mode
            assert kept == 0
        ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
        before = nvme.capacity
        for _ in range(2):
            om.train_step(lambda m, b: m(input_ids=b, labels=b).loss, [ids], 1e-3)
        assert nvme.capacity == before  # the steps' spilled gradients fit the room kept
    finally:
        om.close()
