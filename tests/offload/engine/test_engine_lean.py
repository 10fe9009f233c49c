"""precision=bf16-lean out of core: bf16 weights, no fp32 master, stochastic rounding — and the
same weights as in memory, bit for bit (whole and pieced units, clipping, spilled gradients,
resume)."""
from __future__ import annotations

import copy

import pytest
import torch

from outcore.offload.engine import offload_model
from outcore.optim import AdamW, AdamW8bit, LeanOptimizer
from outcore.planner.sizes import model_spec, unit_bytes
from outcore.training.checkpoint.run_state import load_units, save_units
from outcore.recipes.export import unit_weights
from tests._helpers import causal_lm_loss, needs_cpu_extension, reference_step

LR, WD, VOCAB = 1e-3, 0.01, 4096
OPTIMIZERS = {"adamw": (AdamW, {}), "adamw8bit": (AdamW8bit, {"min_8bit_size": 256}),
              "adamw8bit_dynamic": (AdamW8bit, {"min_8bit_size": 256, "state_format": "dynamic"})}


# One intra-op thread (the comparison is exact either way; on a shared 2-core machine the
# small ops' parallel regions mostly wait at their barriers).
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(factory):
    # a 4096-token vocabulary: the embedding's state is several blocks', so it streams in pieces
    m = factory(seed=0, layers=2, vocab=VOCAB).to(torch.bfloat16)
    m.config.use_cache = False
    return m.train()


def _lean(model, name, **extra):
    cls, kw = OPTIMIZERS[name]
    return LeanOptimizer(cls(model.parameters(), lr=LR, weight_decay=WD, **kw, **extra), seed=7)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


def _assert_same_weights(om, model):
    params = dict(model.named_parameters())
    for unit in om.units:
        for name, w in unit_weights(om, unit).items():
            assert w.dtype == torch.bfloat16 and torch.equal(w, params[name].detach().cpu()), name


@pytest.mark.parametrize("name,clip,spill,split", [
    ("adamw", 0.0, False, True),  # step-in-backward, the embedding in pieces
    ("adamw", 1.0, True, False),  # clipped, gradients spilled to NVMe, every unit whole
    ("adamw8bit", 0.0, False, False),
    ("adamw8bit", 1.0, False, True),  # clipped with gradients kept, pieces
    ("adamw8bit", 1.0, True, True),  # clipped, spilled, pieces
    ("adamw8bit_dynamic", 1.0, False, True),  # the dynamic maps (FP8 is the default), clipped, pieces
])
def test_lean_out_of_core_equals_lean_in_memory(tiny_llama_factory, tmp_path, name, clip, spill, split,
                                                compute_device):
    ref = _model(tiny_llama_factory)
    ooc = copy.deepcopy(ref)
    opt = _lean(ref.to(compute_device), name)
    # prefetch 2: with prefetch 1, AdamW8bit's spilled pieces fragment the HOST window (exact mode too)
    om = offload_model(ooc, _lean(ooc, name), offload="nvme", swap_dir=tmp_path / "swap", prefetch=2,
                       max_grad_norm=clip, spill_grads=spill, split_state=split, device=compute_device)
    assert om.spill == spill and bool(om.mem.units[0].layout.pieces) == split
    for unit in om.mem.units:
        assert "master" not in unit.layout.whole_kinds and {"sr_key", "sr_step"} <= set(unit.layout.whole_kinds)
    for ids in _batches(4):
        assert torch.equal(reference_step(ref, opt, [ids], clip), om.train_step(causal_lm_loss, [ids], LR))
    _assert_same_weights(om, ref)
    embed = ref.model.embed_tokens.weight
    assert int(om.mem.state(0, "sr_step")[0]) == 4 == int(opt.state[embed]["sr_step"])  # once per step
    om.close()


def test_chunked_update_equals_the_whole(tiny_llama_factory, monkeypatch):
    """A tensor larger than a chunk is widened and updated a chunk at a time: the same bits.
    (The reference impl: the C++ one updates bf16 weights in one pass, without chunks.)"""
    import outcore.optim.lean as lean

    whole, chunked = _model(tiny_llama_factory), _model(tiny_llama_factory)
    a, b = _lean(whole, "adamw8bit", impl="ref"), _lean(chunked, "adamw8bit", impl="ref")
    batches = _batches(3)
    for ids in batches:
        reference_step(whole, a, [ids], 1.0)
    monkeypatch.setattr(lean, "CHUNK", 4096)  # the embedding is 32 chunks, a block's matrices 1
    for ids in batches:
        reference_step(chunked, b, [ids], 1.0)
    for (n, p), q in zip(whole.named_parameters(), chunked.parameters()):
        assert torch.equal(p, q), n
    st_a, st_b = a.state[whole.model.embed_tokens.weight], b.state[chunked.model.embed_tokens.weight]
    assert all(torch.equal(st_a[k], st_b[k]) for k in st_a)  # step counts advanced once, not per chunk


def test_one_pass_update_equals_the_chunked(tiny_llama_factory, monkeypatch):
    """AdamW8bit's one-pass bf16-lean update (C++: widen, update, round, a few blocks at a
    time) gives the chunked path's bits: weights, codes, absmax, counts; the fp32-state tensors
    (norms) still take the chunks."""
    import outcore.kernels.adamw8bit as k8

    needs_cpu_extension()
    fused, chunked = _model(tiny_llama_factory), _model(tiny_llama_factory)
    a, b = _lean(fused, "adamw8bit"), _lean(chunked, "adamw8bit", impl="ref")
    calls = []
    real = k8.adamw8bit_update_many
    monkeypatch.setattr("outcore.optim.adamw8bit.adamw8bit_update_many",
                        lambda *args: calls.append(args[-1]) or real(*args))
    for ids in _batches(3):
        reference_step(fused, a, [ids], 1.0)
        reference_step(chunked, b, [ids], 1.0)
    assert len(calls) == 3 and all(calls)  # one lean C++ call per step
    for (n, p), q in zip(fused.named_parameters(), chunked.parameters()):
        assert torch.equal(p, q), n
        assert all(torch.equal(x, y) for x, y in zip(a.state[p].values(), b.state[q].values())), n


def test_lean_moves_weights_that_round_to_nearest_would_keep(tiny_llama_factory):
    """Where the exact fp32 update is under half a bf16 ulp, rounding to nearest keeps the weight;
    stochastic rounding moves a share of them, one ulp towards the exact result."""
    model = _model(tiny_llama_factory)
    before = [p.detach().clone() for p in model.parameters()]
    causal_lm_loss(model, _batches(1)[0]).backward()
    exact = [p.detach().float().requires_grad_() for p in model.parameters()]
    for e, p in zip(exact, model.parameters()):
        e.grad = p.grad.float()
    torch.optim.AdamW(exact, lr=1e-5, weight_decay=0.0).step()
    LeanOptimizer(AdamW(model.parameters(), lr=1e-5, weight_decay=0.0), seed=0).step()
    kept = moved = 0
    for p, b, e in zip(model.parameters(), before, exact):
        rtn_keeps = (e.detach().to(torch.bfloat16) == b) & (e.detach() != b.float())
        went = rtn_keeps & (p.detach() != b)
        kept, moved = kept + int(rtn_keeps.sum()), moved + int(went.sum())
        towards = torch.sign(p.detach().float() - b.float()) == torch.sign(e.detach() - b.float())
        assert bool(towards[went].all())
    assert kept > 1000 and 0 < moved < kept // 2, (moved, kept)


def test_resume_out_of_core_is_bit_identical(tiny_llama_factory, tmp_path, compute_device):
    batches = _batches(4)
    full = _model(tiny_llama_factory)
    om = offload_model(full, _lean(full, "adamw8bit"), offload="nvme", swap_dir=tmp_path / "a", prefetch=2,
                       max_grad_norm=1.0, device=compute_device)
    for ids in batches:
        om.train_step(causal_lm_loss, [ids], LR)
    cut = _model(tiny_llama_factory)
    oc = offload_model(cut, _lean(cut, "adamw8bit"), offload="nvme", swap_dir=tmp_path / "b", prefetch=2,
                       max_grad_norm=1.0, device=compute_device)
    for ids in batches[:2]:
        oc.train_step(causal_lm_loss, [ids], LR)
    save_units(oc, tmp_path / "units")
    oc.close()
    again = _model(tiny_llama_factory)
    resumed = offload_model(again, _lean(again, "adamw8bit"), offload="nvme", swap_dir=tmp_path / "c",
                            prefetch=2, max_grad_norm=1.0, device=compute_device)
    load_units(resumed, tmp_path / "units")
    for ids in batches[2:]:
        resumed.train_step(causal_lm_loss, [ids], LR)
    for unit, other in zip(om.units, resumed.units):
        a, b = unit_weights(om, unit), unit_weights(resumed, other)
        assert all(torch.equal(a[k], b[k]) for k in a)
    om.close()
    resumed.close()


def test_the_plan_counts_no_master(tiny_llama_factory):
    spec = model_spec(_model(tiny_llama_factory))
    kw = dict(method="full", optim="adamw8bit", dtype="bfloat16")
    exact, lean = unit_bytes(spec, **kw), unit_bytes(spec, precision="bf16-lean", **kw)
    for e, n in zip(exact, lean):
        assert e.state - n.state == 4 * n.trainable  # the fp32 master, and nothing else


@pytest.mark.parametrize("name,hparams", [
    ("galore", dict(rank=4, update_proj_gap=2, scale=0.25)),
    ("apollo", dict(rank=4, update_proj_gap=2)),
    ("apollo-mini", dict(update_proj_gap=2)),
    ("frugal", dict(density=0.25, update_proj_gap=2)),
])
def test_projection_optimizers_update_whole_tensors_alike(tiny_llama_factory, tmp_path, name, hparams,
                                                          compute_device):
    """Optimizers that mix a tensor's elements get it whole, in fp32 and in its shape: lean in
    memory == lean out of core, across a projection refresh (step 2)."""
    from outcore.optim import build_optimizer

    ref = tiny_llama_factory(seed=0, layers=2).to(torch.bfloat16).train()
    ref.config.use_cache = False
    ooc = copy.deepcopy(ref)
    opt = LeanOptimizer(build_optimizer(name, ref.to(compute_device).parameters(), lr=LR, **hparams), seed=3)
    om = offload_model(ooc, LeanOptimizer(build_optimizer(name, ooc.parameters(), lr=LR, **hparams), seed=3),
                       offload="nvme", swap_dir=tmp_path / "swap", prefetch=1, device=compute_device)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        assert torch.equal(reference_step(ref, opt, [ids], 0.0), om.train_step(causal_lm_loss, [ids], LR))
    _assert_same_weights(om, ref)
    om.close()


def test_lean_adamw8bit_writes_only_weights_and_codes(tiny_llama_factory, tmp_path):
    """With the state on NVMe, the 8-bit moments' block scales, the step counts and the small
    tensors' moments stay in RAM (``unit_sizes.ram_kinds``): a step writes each tensor's bf16
    weight and two 1-byte codes per element (and a unit of small tensors alone, the tied head's
    final norm, keeps its state on NVMe: no kind of it is small next to the others)."""
    model = _model(tiny_llama_factory)
    n = sum(p.numel() for p in model.parameters())
    om = offload_model(model, _lean(model, "adamw8bit"), offload="nvme", swap_dir=tmp_path / "swap", prefetch=2)
    coded = [u for u in om.mem.units if "m_codes" in u.layout.kinds()]
    assert len(coded) == len(om.mem.units) - 1  # all but the head
    for unit in coded:
        for part, h in unit.layout.handles.items():
            expect = "NVME" if part.kind in ("w", "m_codes", "v_codes") else "HOST"
            assert h.home.name == expect, (unit.name, str(part))
    batches = _batches(3)
    om.train_step(causal_lm_loss, [batches[0]], LR)
    om.mem.flush()  # write-behind runs on past the step: count whole steps' write-backs
    before = om.tier_stats()["NVME"].written_bytes
    for ids in batches[1:]:
        om.train_step(causal_lm_loss, [ids], LR)
    om.mem.flush()
    per_step = (om.tier_stats()["NVME"].written_bytes - before) / 2
    extents = sum(len(u.layout.handles) for u in om.mem.units)  # each write is 4 KiB-padded
    assert 4 * n - 4096 * extents <= per_step <= 4 * n + 4096 * extents, (per_step, 4 * n)
    om.close()
