"""Every memory-lean optimizer streams exactly: out-of-core == in memory, bit for bit.

Weights and optimizer state live on NVMe (a ``tmp_path`` swap directory) behind a DEVICE
budget of three transformer blocks (2-block model: fewer than its units); the engine fetches each unit's state,
calls the optimizer's ``update`` on it (step-in-backward, or after the backward when gradients are
clipped) and writes it back. The same optimizer stepping the same model in memory must give
the same losses and the same weights. Several steps include projection / subspace refreshes
(``update_proj_gap=2``): GaLore's SVD written into its streamed ``proj`` state, APOLLO's and
FRUGAL's seeds advanced in theirs.
"""
from __future__ import annotations

import pytest
import torch

from outcore.offload.engine import offload_model
from outcore.offload.store import Tier
from outcore.optim import build_optimizer
from outcore.recipes.export import unit_weights
from tests._helpers import causal_lm_loss, reference_step

LR, WD, STEPS = 1e-3, 0.01, 3  # refreshes at step 2 (update_proj_gap=2)

# Small ranks, so that the projections are real (the tiny model's matrices are 64 wide).
HPARAMS = {
    "galore": dict(rank=4, update_proj_gap=2, scale=0.25),
    "apollo": dict(rank=4, update_proj_gap=2),
    "apollo-mini": dict(update_proj_gap=2),
    "frugal": dict(density=0.25, update_proj_gap=2),
    "adamw8bit": dict(min_8bit_size=256),
}


# One intra-op thread for both runs (the comparison is exact either way): on a shared,
# oversubscribed machine a 2-thread LAPACK SVD (GaLore's refresh) waits ~30x longer at
# its barriers than it computes.
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(factory, layers=2):
    m = factory(seed=0, layers=layers)
    m.config.use_cache = False
    return m.train()


def _block_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())


@pytest.mark.parametrize("name,clip", [
    ("galore", 0.0), ("apollo", 0.0), ("apollo-mini", 0.0), ("frugal", 0.0), ("adamw8bit", 0.0),
    # clipping: the updates run after the backward, on kept gradients
    pytest.param("galore", 1.0, marks=pytest.mark.slow(ci=True)),
    pytest.param("frugal", 1.0, marks=pytest.mark.slow(ci=True)),
])
def test_streamed_optimizer_equals_in_memory(tiny_llama_factory, tmp_path, name, clip, compute_device):
    ref, ooc = _model(tiny_llama_factory).to(compute_device), _model(tiny_llama_factory)
    hp = dict(lr=LR, weight_decay=WD, **HPARAMS[name])
    opt = build_optimizer(name, list(ref.parameters()), **hp)
    budget = 3 * _block_bytes(ref)
    om = offload_model(ooc, build_optimizer(name, list(ooc.parameters()), **hp), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=clip,
                       device_bytes=budget, device=compute_device)
    assert om.store.budget(Tier.DEVICE) <= budget
    g = torch.Generator().manual_seed(4)
    for step in range(STEPS):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        want = reference_step(ref, opt, [ids], clip)
        assert torch.equal(want, om.train_step(causal_lm_loss, [ids], LR)), f"step {step}"
    named = dict(ref.named_parameters())
    for unit in om.units:
        for pname, w in unit_weights(om, unit).items():
            assert torch.equal(w, named[pname].detach().cpu()), pname
    stats = om.tier_stats()
    assert stats["NVME"].read_bytes > 0 and stats["NVME"].written_bytes > 0  # it did stream
    om.close()
    assert not (tmp_path / "swap").exists()


def test_refreshes_happened_in_the_reference(tiny_llama_factory):
    """The steps above cross projection refreshes: seeds and projections changed."""
    model = _model(tiny_llama_factory, layers=1)
    opts = {n: build_optimizer(n, list(model.parameters()), lr=LR, **HPARAMS[n])
            for n in ("galore", "apollo", "frugal")}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    p = model.model.layers[0].self_attn.q_proj.weight
    first = {}
    for step in range(3):
        for n, opt in opts.items():
            model.zero_grad(set_to_none=True)
            causal_lm_loss(model, ids).backward()
            opt.step()
            st = opt.state[p]
            key = "proj" if n == "galore" else "seed"
            if step == 0:
                first[n] = st[key].clone()
    for n, opt in opts.items():
        key = "proj" if n == "galore" else "seed"
        assert not torch.equal(opt.state[p][key], first[n]), n
