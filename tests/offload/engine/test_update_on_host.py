"""``update_on="host"``: weights computed on the accelerator, optimizer state updated in HOST by
the CPU (ZeRO-Offload's placement). Checked on the simulated accelerator, whose ops are the
CPU's: the run equals the CPU-only out-of-core run bit for bit (same update kernels, same
gradients), and the state never crosses the link."""
from __future__ import annotations

import threading

import pytest
import torch

from outcore.errors import ConfigError
from outcore.offload.engine import offload_model
from outcore.offload.store import Tier
from outcore.optim import AdamW, AdamW8bit
from outcore.recipes.export import unit_weights
from tests._helpers import causal_lm_loss
from tests.conftest import require_sim

LR, WD = 1e-3, 0.01


def _run(factory, tmp_path, device, *, update_on="device", dtype=torch.float32, opt=AdamW, offload="nvme",
         clip=0.0, accum=1, vocab=256, steps=4, name="run"):
    """Train a tiny Llama out of core; returns (losses, final weights by name, engine stats)."""
    from outcore.offload import simdevice

    model = factory(seed=0, layers=3, vocab=vocab).to(dtype).train()
    model.config.use_cache = False
    om = offload_model(model, opt(model.parameters(), lr=LR, weight_decay=WD), offload=offload,
                       swap_dir=tmp_path / name, prefetch=1, max_grad_norm=clip, grad_accum=accum,
                       device=device, update_on=update_on)
    g = torch.Generator().manual_seed(1)
    simdevice.reset_report()
    losses = []
    for _ in range(steps):
        micro = [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(accum)]
        losses.append(om.train_step(causal_lm_loss, micro, LR).cpu())
    link = simdevice.report()
    weights = {n: w for unit in om.units for n, w in unit_weights(om, unit).items()}
    info = {"state_tier": om.mem.state_tier, "device_budget": om.store.budget(Tier.DEVICE),
            "link_bytes": link["bytes_h2d"] + link["bytes_d2h"]}
    om.close()
    return torch.stack(losses), weights, info


@pytest.mark.parametrize("dtype,opt,offload,clip,accum,vocab", [
    (torch.float32, AdamW, "nvme", 0.0, 1, 256),  # step-in-backward: gradients come down per unit
    (torch.float32, AdamW, "nvme", 1.0, 2, 256),  # spilled to HOST, accumulated there, clipped
    (torch.bfloat16, AdamW8bit, "cpu", 1.0, 1, 256),  # fp32 masters in HOST, 8-bit state, bf16 up
    (torch.bfloat16, AdamW8bit, "nvme", 0.0, 1, 256),  # the same, each update beside the backward
    (torch.float32, AdamW, "nvme", 1.0, 1, 4096),  # the embedding's state updated in pieces
])
def test_update_on_host_equals_the_cpu_run(tiny_llama_factory, tmp_path, dtype, opt, offload, clip, accum, vocab):
    require_sim()
    kw = dict(dtype=dtype, opt=opt, offload=offload, clip=clip, accum=accum, vocab=vocab)
    want_loss, want_w, cpu = _run(tiny_llama_factory, tmp_path, "cpu", name="cpu", **kw)
    got_loss, got_w, host = _run(tiny_llama_factory, tmp_path, "sim", update_on="host", name="host", **kw)
    assert cpu["state_tier"] is Tier.HOST and host["state_tier"] is Tier.HOST
    assert torch.equal(want_loss, got_loss)
    assert want_w.keys() == got_w.keys()
    for name, w in want_w.items():
        assert torch.equal(w, got_w[name]), name


def test_update_on_host_keeps_the_state_off_the_device_and_the_link(tiny_llama_factory, tmp_path):
    """Against the same run updated on the device: the DEVICE arena holds weights only, and the
    link carries less (the state's bytes stay in HOST; gradients and weights still cross)."""
    require_sim()
    _, dev_w, dev = _run(tiny_llama_factory, tmp_path, "sim", update_on="device", offload="cpu", name="dev")
    _, host_w, host = _run(tiny_llama_factory, tmp_path, "sim", update_on="host", offload="cpu", name="host")
    assert dev["state_tier"] is Tier.DEVICE and host["state_tier"] is Tier.HOST
    assert host["device_budget"] < dev["device_budget"]
    assert 0 < host["link_bytes"] < dev["link_bytes"]
    for name, w in dev_w.items():  # both update with CPU kernels here (the sim's ops are the CPU's)
        assert torch.allclose(w, host_w[name], rtol=0, atol=1e-6), name


def test_the_cpu_updates_while_the_backward_goes_on(tiny_llama_factory, tmp_path):
    """Step-in-backward, a unit's update runs on the worker thread while the autograd thread goes on:
    each update but the backward's last sees a later unit's gradient arrive before it is done (run
    in the autograd thread, it would hold the backward: none would come)."""
    require_sim()
    model = tiny_llama_factory(seed=0, layers=3, vocab=256).train()
    model.config.use_cache = False
    arrived, cond = [0], threading.Condition()

    def gradient_ready(_):
        with cond:
            arrived[0] += 1
            cond.notify_all()

    for p in model.parameters():  # (before the engine's hooks: each gradient is counted before its unit's update)
        p.register_post_accumulate_grad_hook(gradient_ready)
    opt = AdamW(model.parameters(), lr=LR)
    om = offload_model(model, opt, offload="cpu", swap_dir=tmp_path / "s", prefetch=1, device="sim",
                       update_on="host")
    seen, update = [], opt.update

    def watched(params, grads, states, group):
        with cond:  # wait (2 s at most) for one more gradient than have arrived
            at = arrived[0]
            cond.wait_for(lambda: arrived[0] > at, timeout=2.0)
            seen.append((threading.current_thread().name, len(params), arrived[0]))
        return update(params, grads, states, group)

    opt.update = watched
    om.train_step(causal_lm_loss, [torch.randint(0, 256, (2, 16))], LR)
    om.close()
    assert len(seen) == len([u for u in om.units if u.step.trainable])
    assert all(name.startswith("outcore-host-update") for name, _, _ in seen)
    done = 0  # gradients arrived when the unit's update was handed over: its own and every earlier unit's
    for _, n, arrived_by_then in seen[:-1]:
        done += n
        assert arrived_by_then > done  # a later unit's gradient came while this update was pending


def test_unknown_update_on_is_one_line(tiny_llama_factory, tmp_path):
    model = tiny_llama_factory(seed=0, layers=1)
    with pytest.raises(ConfigError, match="update_on='gpu'"):
        offload_model(model, AdamW(model.parameters(), lr=LR), offload="cpu", swap_dir=None, device="cpu",
                      update_on="gpu")
