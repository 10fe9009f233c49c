"""A unit whose optimizer state dwarfs a block's (the embedding) is updated piece by piece:
its state streams through the HOST window in block-sized pieces, bit-identical to the whole."""
from __future__ import annotations

import pytest
import torch

from outcore.offload.handle import Tier
from outcore.offload.training import offload_model
from outcore.offload.unit_sizes import PIECE_ALIGN, state_pieces
from outcore.optim import AdamW, GaLore

LR, WD, VOCAB = 1e-3, 0.01, 4096


def _model(factory, tie=True, dtype=torch.float32):
    # a 4096-token vocabulary: the embedding's Adam state (2 MiB) is ~7 blocks' (0.3 MiB)
    m = factory(seed=0, layers=3, vocab=VOCAB, tie=tie).to(dtype)
    m.config.use_cache = False
    return m.train()


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _reference_step(model, opt, ids, clip):
    loss = _loss(model, ids)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _embed_state_bytes(om) -> int:
    return sum(om.mem.state(0, kind).numel() * om.mem.state(0, kind).element_size() for kind in om.mem.kinds(0))


@pytest.mark.parametrize("offload,clip,tie", [
    ("nvme", 0.0, True),  # step-in-backward; the tied head's gradient joins the embedding's
    ("nvme", 0.0, False),  # an untied head (norm + lm_head) is as large and not split: neither is the embedding
    ("nvme", 1.0, True),  # clipping with gradients kept in memory: updates after the backward
    ("nvme-spill", 1.0, True),  # clipping with gradients spilled to NVMe, in pieces too
])
def test_pieced_embedding_is_bit_identical(tiny_llama_factory, tmp_path, offload, clip, tie):
    ref, ooc = _model(tiny_llama_factory, tie), _model(tiny_llama_factory, tie)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    spill = offload == "nvme-spill"
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=clip, spill_grads=spill)
    assert om.engine.spill == spill
    if tie:
        assert len(om.mem.units[0].pieces) >= 4, "the embedding's state should be split"
        assert all(a % PIECE_ALIGN == 0 for a, _ in om.mem.units[0].pieces)
        # the HOST window is sized by blocks: it cannot hold the embedding's state whole
        assert om.store.budget(Tier.HOST) < _embed_state_bytes(om)
    else:
        assert not any(u.pieces for u in om.mem.units)  # the window must hold the head's state whole anyway
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        ids = torch.randint(0, VOCAB, (2, 24), generator=g)
        assert torch.equal(_reference_step(ref, opt, ids, clip), om.train_step(_loss, [ids], LR))
    params = dict(ref.named_parameters())
    for unit in om.engine.units:
        for name, w in om.named_weights(unit).items():
            assert torch.equal(w, params[name].detach()), name
    embed = ref.model.embed_tokens.weight
    state = opt.state[embed]
    n = embed.numel()
    assert torch.equal(om.mem.state(0, "exp_avg")[:n], state["exp_avg"].view(-1))
    assert torch.equal(om.mem.state(0, "exp_avg_sq")[:n], state["exp_avg_sq"].view(-1))
    assert torch.equal(om.mem.state(0, "step")[0], state["step"])  # advanced once per step, not per piece
    om.close()


def test_pieced_mixed_precision_updates_pieces_of_the_master(tiny_llama_factory, tmp_path):
    """bf16 weights: the fp32 master is split with the moments and rounded piece by piece."""
    runs = []
    for pieces in (True, False):
        m = _model(tiny_llama_factory, dtype=torch.bfloat16)
        om = offload_model(m, AdamW(m.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                           swap_dir=tmp_path / f"swap{pieces}", prefetch=1)
        if not pieces:  # the same run with the state whole
            assert any(u.pieces for u in om.mem.units)
            om.close()
            m = _model(tiny_llama_factory, dtype=torch.bfloat16)
            om = _unpieced(m, tmp_path / "swap_whole")
        else:
            assert "master" in om.mem.units[0].ratios
        g = torch.Generator().manual_seed(3)
        losses = [om.train_step(_loss, [torch.randint(0, VOCAB, (2, 16), generator=g)], LR) for _ in range(4)]
        runs.append((losses, om.mem.weights(0), om.mem.state(0, "master")))
        om.close()
    (l1, w1, m1), (l2, w2, m2) = runs
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert torch.equal(w1, w2) and torch.equal(m1, m2)


def _unpieced(model, swap_dir):
    """The model offloaded with its state never split."""
    om = offload_model(model, AdamW(model.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=swap_dir, prefetch=1, split_state=False)
    assert not any(u.pieces for u in om.mem.units)
    return om


def test_checkpoint_of_pieced_state_resumes_whole_and_back(tiny_llama_factory, tmp_path):
    """A checkpoint holds each state joined: it resumes with or without the split."""
    m = _model(tiny_llama_factory)
    om = offload_model(m, AdamW(m.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "a", prefetch=1)
    assert any(u.pieces for u in om.mem.units)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(6)]
    for ids in batches[:3]:
        om.train_step(_loss, [ids], LR)
    om.save(tmp_path / "ckpt")
    rest = [om.train_step(_loss, [ids], LR) for ids in batches[3:]]
    final = om.mem.state(0, "exp_avg_sq")
    om.close()

    whole = _unpieced(_model(tiny_llama_factory), tmp_path / "b")
    whole.load(tmp_path / "ckpt")
    assert all(torch.equal(want, whole.train_step(_loss, [ids], LR)) for want, ids in zip(rest, batches[3:]))
    assert torch.equal(whole.mem.state(0, "exp_avg_sq"), final)
    whole.save(tmp_path / "ckpt_whole")
    whole.close()

    m2 = _model(tiny_llama_factory)
    again = offload_model(m2, AdamW(m2.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                          swap_dir=tmp_path / "c", prefetch=1)
    again.load(tmp_path / "ckpt_whole")
    assert torch.equal(again.mem.state(0, "exp_avg_sq"), final)
    again.close()


def test_only_elementwise_optimizers_split(tiny_llama_factory):
    """A projection method's update mixes elements: its state is never split."""
    from outcore.offload.units import causal_lm_units

    m = _model(tiny_llama_factory)
    units = causal_lm_units(m)
    assert state_pieces(units[0], AdamW(m.parameters()), 64 << 10) is not None
    assert state_pieces(units[0], GaLore(m.parameters(), rank=4), 64 << 10) is None
    assert state_pieces(units[0], AdamW(m.parameters()), 64 << 20) is None  # already small enough
    assert state_pieces(units[1], AdamW(m.parameters()), 1024) is None  # a block: many tensors


def test_pieced_adamw8bit_is_bit_identical(tiny_llama_factory, tmp_path):
    """8-bit moments: pieces start on quantization-block boundaries, so each block's absmax
    is the same as when the tensor is updated whole."""
    from outcore.optim import AdamW8bit

    ref, ooc = _model(tiny_llama_factory), _model(tiny_llama_factory)
    opt = AdamW8bit(ref.parameters(), lr=LR, weight_decay=WD)
    om = offload_model(ooc, AdamW8bit(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1)
    assert len(om.mem.units[0].pieces) >= 2 and "m_absmax" in om.mem.units[0].ratios
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (2, 24), generator=g)
        assert torch.equal(_reference_step(ref, opt, ids, 0.0), om.train_step(_loss, [ids], LR))
    state = opt.state[ref.model.embed_tokens.weight]
    for kind in ("m_codes", "m_absmax", "v_codes", "v_absmax"):
        assert torch.equal(om.mem.state(0, kind)[:state[kind].numel()], state[kind].view(-1)), kind
    om.close()


def test_pieced_spill_with_accumulation_is_bit_identical(tiny_llama_factory, tmp_path):
    """Two micro-batches: the second adds each spilled piece into its gradient (old + new) before
    the norm is taken on the whole; then each piece is clipped and updated."""
    ref, ooc = _model(tiny_llama_factory), _model(tiny_llama_factory)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=0.5, grad_accum=2)
    assert om.engine.spill and any(u.pieces for u in om.mem.units)
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        micro = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(2)]
        want = torch.zeros(())
        for ids in micro:
            loss = _loss(ref, ids) / 2
            loss.backward()
            want += loss.detach()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.equal(want, om.train_step(_loss, micro, LR))
    params = dict(ref.named_parameters())
    for unit in om.engine.units:
        for name, w in om.named_weights(unit).items():
            assert torch.equal(w, params[name].detach()), name
    assert not any(part.kind == "g" for u in om.mem.units for part in u.handles)  # spilled pieces dropped
    om.close()
