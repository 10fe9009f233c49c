"""Mixed precision out of core: bf16 compute, fp32 master weights and state in the state tier."""
from __future__ import annotations

import copy

import pytest
import torch

from outcore.offload.engine import Part, offload_model
from outcore.offload.store import Tier
from outcore.optim import AdamW
from outcore.recipes.export import unit_weights
from tests._helpers import causal_lm_loss

LR, WD = 1e-3, 0.01


class _MasterReference:
    """The textbook in-memory mixed-precision loop: bf16 model, fp32 masters stepped by torch's
    fused AdamW on fp32 copies of the gradients, then rounded back into the model."""

    def __init__(self, model, clip):
        self.model, self.clip = model, clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=WD, fused=True)

    def step(self, ids):
        """In memory, on the model's device (the batch moved there, as the engine moves it)."""
        loss = causal_lm_loss(self.model, ids.to(self.params[0].device))
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        for p, m in zip(self.params, self.masters):
            m.grad, p.grad = p.grad.float(), None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        return loss.detach()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_bf16_with_fp32_masters_equals_the_reference_loop(tiny_llama_factory, tmp_path, clip, compute_device):
    model = tiny_llama_factory(seed=0, layers=4).to(torch.bfloat16)
    model.config.use_cache = False
    ooc = copy.deepcopy(model).train()
    ref = _MasterReference(model.to(compute_device).train(), clip)  # masters made on the device
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=clip, device=compute_device)
    kinds = om.mem.units[1].layout.whole_kinds
    assert "master" in kinds
    assert om.mem.units[1].layout.handles[Part("master")].dtype == torch.float32
    assert om.mem.units[1].layout.handles[Part("exp_avg")].dtype == torch.float32  # state follows the master
    assert om.mem.units[1].layout.handles[Part("w")].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        ids = torch.randint(0, 256, (2, 24), generator=g)
        assert torch.equal(ref.step(ids), om.train_step(causal_lm_loss, [ids], LR))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    masters = dict(zip(names, ref.masters))
    for unit in om.units:
        master = om.mem.state(unit.index, "master")
        for k, slot in enumerate(unit.slots):
            s = unit.layout.states[k]["master"]
            got = master[s.offset:s.offset + s.shape.numel()].view(s.shape)
            assert torch.equal(got, masters[slot.name].detach().cpu()), slot.name
        for name, w in unit_weights(om, unit).items():
            assert w.dtype == torch.bfloat16
            assert torch.equal(w, dict(model.named_parameters())[name].detach().cpu()), name
    om.close()


def test_meta_model_masters_hold_the_full_precision_weights(tiny_llama_factory, tmp_path, compute_device):
    """Lazily built (meta device, bf16): the master is filled in fp32 from the source and the
    compute weights are its rounding; nothing is lost to a bf16 round trip."""
    source = tiny_llama_factory(seed=0, layers=2)
    state = {n: p.detach().clone() for n, p in source.named_parameters()}
    with torch.device("meta"):
        model = type(source)(source.config).to(torch.bfloat16)
    from outcore.models._lazy import materialize_buffers
    materialize_buffers(model, source.config)
    om = offload_model(model, AdamW(model.parameters(), lr=LR), offload="cpu", swap_dir=None,
                       init_weights=lambda slot, t: t.copy_(state[slot.name]), device=compute_device)
    for unit in om.units:
        master = om.mem.state(unit.index, "master")
        for k, slot in enumerate(unit.slots):
            s = unit.layout.states[k]["master"]
            assert torch.equal(master[s.offset:s.offset + s.shape.numel()].view(s.shape), state[slot.name])
        for name, w in unit_weights(om, unit).items():
            assert torch.equal(w, state[name].to(torch.bfloat16)), name
    om.close()


def test_master_weights_off_trains_the_16bit_weights(tiny_llama_factory, tmp_path):
    model = tiny_llama_factory(seed=0, layers=2).to(torch.bfloat16)
    om = offload_model(model, AdamW(model.parameters(), lr=LR), offload="cpu", swap_dir=None,
                       master_weights=False)
    assert all("master" not in u.layout.whole_kinds for u in om.mem.units)
    assert om.mem.units[1].layout.handles[Part("exp_avg")].dtype == torch.bfloat16
    assert om.store.budget(Tier.HOST) > 0
    om.close()
