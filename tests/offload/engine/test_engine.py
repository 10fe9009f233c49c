"""The out-of-core engine: streamed training equals in-memory training, bit for bit."""
from __future__ import annotations

import json

import pytest
import torch

from outcore.errors import BudgetError
from outcore.offload.aligned import align_up
from outcore.offload.device import is_accelerator
from outcore.offload.engine import offload_model
from outcore.offload.store import Tier
from outcore.optim import AdamW
from outcore.training.checkpoint.run_state import load_units, save_units
from outcore.recipes.export import export_offloaded, unit_weights
from tests._helpers import causal_lm_loss, reference_step

LR, WD = 1e-3, 0.01


def _model(factory, layers=6):
    m = factory(seed=0, layers=layers)
    m.config.use_cache = False
    return m.train()


def _block_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())


@pytest.mark.parametrize("offload,clip,accum", [
    ("nvme", 0.0, 1),  # step-in-backward
    ("nvme", 1.0, 1),  # clipping: gradients kept, updates after the norm
    ("cpu", 0.0, 2),  # accumulation over two micro-batches
    ("nvme", 1.0, 2),  # both, with every unit's gradient spilled to NVMe until the norm is known
])
def test_streamed_training_is_bit_identical(tiny_llama_factory, tmp_path, offload, clip, accum, compute_device):
    ref, ooc = _model(tiny_llama_factory).to(compute_device), _model(tiny_llama_factory)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    # three blocks' weights; on an accelerator their AdamW moments too (the update runs there)
    cap = 3 * _block_bytes(ref) * (3 if is_accelerator(compute_device) else 1)
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload=offload,
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=clip, grad_accum=accum,
                       device_bytes=cap, device=compute_device)
    assert om.store.budget(Tier.DEVICE) <= cap
    assert om.spill == (offload == "nvme" and clip > 0)  # gradients never all in RAM
    if offload == "nvme":  # the swap file holds the units' extents, no reservation beyond them
        assert om.store.nvme.capacity == om.store.nvme.held
    g = torch.Generator().manual_seed(1)
    steps = 20 if offload == "nvme" and not clip else 6
    for _ in range(steps):
        micro = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(accum)]
        want = reference_step(ref, opt, micro, clip)
        got = om.train_step(causal_lm_loss, micro, LR)
        assert torch.equal(want, got)
    for unit in om.units:
        for name, w in unit_weights(om, unit).items():
            assert torch.equal(w, dict(ref.named_parameters())[name].detach().cpu()), name
    if offload == "nvme":
        stats = om.tier_stats()
        assert stats["NVME"].read_bytes > 0 and stats["NVME"].written_bytes > 0
    om.close()
    assert not (tmp_path / "swap").exists()


@pytest.mark.parametrize("split", [False, True])
def test_gradients_homed_in_ram_never_reach_the_disk(tiny_llama_factory, tmp_path, split, compute_device):
    """Weights and state on NVMe, kept gradients spilled to HOST (``homes``' third tier): the
    in-memory run's weights bit for bit, and a step writes weights and state back, no gradient
    (whole units, and pieced ones whose gradient spills a piece at a time)."""
    # a 4096-token vocabulary: the embedding's state is ~7 blocks', streamed in pieces when split
    ref, ooc = (tiny_llama_factory(seed=0, layers=3, vocab=4096).train() for _ in range(2))
    ref = ref.to(compute_device)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    homes = [(Tier.NVME, Tier.NVME, Tier.HOST)] * (3 + 2)  # embedding, three blocks, the final norm
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme", homes=homes,
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=1.0, grad_accum=2,
                       split_state=split, device=compute_device)
    assert om.spill and len(om.units) == len(homes) and bool(om.mem.units[0].layout.pieces) == split
    g = torch.Generator().manual_seed(3)
    placed = om.tier_stats()["NVME"].written_bytes
    for _ in range(3):
        micro = [torch.randint(0, 4096, (2, 16), generator=g) for _ in range(2)]
        assert torch.equal(reference_step(ref, opt, micro, 1.0), om.train_step(causal_lm_loss, micro, LR))
    for unit in om.units:
        for name, w in unit_weights(om, unit).items():
            assert torch.equal(w, dict(ref.named_parameters())[name].detach().cpu()), name
    on_disk = [h for u in om.units for h in u.layout.handles.values() if h.home is Tier.NVME]
    stored = sum(align_up(h.nbytes) for h in on_disk)  # a handle's extent, O_DIRECT-aligned
    written = om.tier_stats()["NVME"].written_bytes - placed
    assert 0 < written <= 3 * stored  # each step rewrites what it updated, never a gradient
    om.close()


def test_checkpoint_resume_and_export(tiny_llama_factory, tmp_path, compute_device):
    from transformers import AutoModelForCausalLM

    ref, ooc = _model(tiny_llama_factory, 3).to(compute_device), _model(tiny_llama_factory, 3)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", device=compute_device)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(4)]
    for ids in batches[:2]:
        reference_step(ref, opt, [ids], 0.0)
        om.train_step(causal_lm_loss, [ids], LR)
    save_units(om, tmp_path / "ckpt")
    om.train_step(causal_lm_loss, [batches[3]], LR)  # diverge, then roll back to the checkpoint
    load_units(om, tmp_path / "ckpt")
    for ids in batches[2:]:
        assert torch.equal(reference_step(ref, opt, [ids], 0.0), om.train_step(causal_lm_loss, [ids], LR))
    export_offloaded(om, ooc, tmp_path / "hf")
    # one shard per unit that owns weights, named the Hugging Face way
    n = sum(1 for u in om.units if u.slots)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert n == 5 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, dict(ref.named_parameters())[name].detach().cpu()), name
    om.close()


def test_device_budget_below_one_unit_is_a_clear_error(tiny_llama_factory, tmp_path):
    ooc = _model(tiny_llama_factory, 2)
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR), offload="cpu", swap_dir=None,
                       device_bytes=8192)
    with pytest.raises(BudgetError, match="DEVICE tier budget"):
        om.train_step(causal_lm_loss, [torch.randint(0, 256, (1, 8))], LR)
    om.close()


@pytest.mark.parametrize("name", ["adamw8bit", "apollo-mini"])
def test_streamed_memory_lean_optimizers_equal_their_in_memory_runs(tiny_llama_factory, tmp_path, name,
                                                                     compute_device):
    """8-bit and low-rank state streams through NVMe like AdamW's: same bits as in memory."""
    from outcore.optim import build_optimizer

    ref, ooc = _model(tiny_llama_factory, 3).to(compute_device), _model(tiny_llama_factory, 3)
    hp = dict(lr=LR, weight_decay=WD)
    opt = build_optimizer(name, [p for p in ref.parameters()], **hp)
    om = offload_model(ooc, build_optimizer(name, [p for p in ooc.parameters()], **hp), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, device=compute_device)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = torch.randint(0, 256, (2, 32), generator=g)
        assert torch.equal(reference_step(ref, opt, [ids], 0.0), om.train_step(causal_lm_loss, [ids], LR))
    for unit in om.units:
        for pname, w in unit_weights(om, unit).items():
            assert torch.equal(w, dict(ref.named_parameters())[pname].detach().cpu()), pname
    om.close()
