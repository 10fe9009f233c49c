"""A unit whose optimizer state dwarfs a block's (the embedding) is updated piece by piece:
its state streams through the HOST window in block-sized pieces, bit-identical to the whole."""
from __future__ import annotations

import pytest
import torch

from outcore.offload.device import is_accelerator, supports_sparse
from outcore.offload.store import Tier
from outcore.offload.engine import offload_model, unit_sizes
from outcore.offload.engine.unit_sizes import PIECE_ALIGN, state_pieces, step_window, weights_arena_bytes, window_bytes
from outcore.optim import AdamW, GaLore
from outcore.training.checkpoint.run_state import load_units, save_units
from outcore.recipes.export import unit_weights
from tests._helpers import causal_lm_loss, reference_step

LR, WD, VOCAB = 1e-3, 0.01, 4096


def _model(factory, tie=True, dtype=torch.float32):
    # a 4096-token vocabulary: the embedding's Adam state (2 MiB) is ~7 blocks' (0.3 MiB)
    m = factory(seed=0, layers=3, vocab=VOCAB, tie=tie).to(dtype)
    m.config.use_cache = False
    return m.train()


def _embed_state_bytes(om) -> int:
    return sum(om.mem.state(0, kind).numel() * om.mem.state(0, kind).element_size() for kind in om.mem.kinds(0))


@pytest.mark.parametrize("offload,clip,tie", [
    ("nvme", 0.0, True),  # step-in-backward; the tied head's gradient joins the embedding's
    ("nvme", 0.0, False),  # an untied head (final norm + lm_head: two tensors) is split like the embedding
    ("nvme", 1.0, True),  # clipping with gradients kept in memory: updates after the backward
    ("nvme-spill", 1.0, True),  # clipping with gradients spilled to NVMe, in pieces too
])
def test_pieced_embedding_is_bit_identical(tiny_llama_factory, tmp_path, offload, clip, tie, compute_device):
    ref, ooc = _model(tiny_llama_factory, tie).to(compute_device), _model(tiny_llama_factory, tie)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    spill = offload == "nvme-spill"
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=clip, spill_grads=spill,
                       device=compute_device)
    assert om.spill == spill
    assert len(om.mem.units[0].layout.pieces) >= 4, "the embedding's state should be split"
    assert all(p.lo % PIECE_ALIGN == 0 for p in om.mem.units[0].layout.pieces)
    # the HOST window is sized by blocks: it cannot hold the embedding's state whole (on an accelerator
    # HOST also stages the weights window on its way to the device: the rest stages the state)
    staging = window_bytes([weights_arena_bytes(u) for u in om.units], 2) if is_accelerator(compute_device) else 0
    assert om.store.budget(Tier.HOST) - staging < _embed_state_bytes(om)
    head = om.mem.units[-1]
    assert bool(head.layout.pieces) == (not tie)
    # the embedding's input-side gradient arrives as rows (untied: densified per piece), but with clipping untied;
    # a device without sparse tensors (the simulated accelerator) takes autograd's dense gradient
    assert ("forward" in ooc.model.embed_tokens.__dict__) == ((tie or not clip) and supports_sparse(compute_device))
    if not tie:  # the final norm's 64 elements and the first rows of lm_head share the first piece
        assert [seg[:2] for seg in head.layout.pieces[0].segments] == [(0, 0), (1, 0)] and len(head.slots) == 2
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        ids = torch.randint(0, VOCAB, (2, 24), generator=g)
        assert torch.equal(reference_step(ref, opt, [ids], clip), om.train_step(causal_lm_loss, [ids], LR))
    params = dict(ref.named_parameters())
    for unit in om.units:
        for name, w in unit_weights(om, unit).items():
            assert torch.equal(w, params[name].detach().cpu()), name
    embed = ref.model.embed_tokens.weight
    state = opt.state[embed]
    n = embed.numel()
    assert torch.equal(om.mem.state(0, "exp_avg")[:n], state["exp_avg"].view(-1).cpu())
    assert torch.equal(om.mem.state(0, "exp_avg_sq")[:n], state["exp_avg_sq"].view(-1).cpu())
    assert torch.equal(om.mem.state(0, "step")[0], state["step"].cpu())  # advanced once per step, not per piece
    om.close()


def test_pieced_mixed_precision_updates_pieces_of_the_master(tiny_llama_factory, tmp_path, compute_device):
    """bf16 weights: the fp32 master is split with the moments and rounded piece by piece."""
    runs = []
    for pieces in (True, False):
        m = _model(tiny_llama_factory, dtype=torch.bfloat16)
        om = offload_model(m, AdamW(m.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                           swap_dir=tmp_path / f"swap{pieces}", prefetch=1, device=compute_device)
        if not pieces:  # the same run with the state whole
            assert any(u.layout.pieces for u in om.mem.units)
            om.close()
            m = _model(tiny_llama_factory, dtype=torch.bfloat16)
            om = _unpieced(m, tmp_path / "swap_whole", compute_device)
        else:
            assert "master" in om.mem.units[0].layout.ratios
        g = torch.Generator().manual_seed(3)
        losses = [om.train_step(causal_lm_loss, [torch.randint(0, VOCAB, (2, 16), generator=g)], LR) for _ in range(4)]
        runs.append((losses, om.mem.weights(0), om.mem.state(0, "master")))
        om.close()
    (l1, w1, m1), (l2, w2, m2) = runs
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert torch.equal(w1, w2) and torch.equal(m1, m2)


def _unpieced(model, swap_dir, device):
    """The model offloaded with its state never split."""
    om = offload_model(model, AdamW(model.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=swap_dir, prefetch=1, split_state=False, device=device)
    assert not any(u.layout.pieces for u in om.mem.units)
    return om


def test_checkpoint_of_pieced_state_resumes_whole_and_back(tiny_llama_factory, tmp_path, compute_device):
    """A checkpoint holds each state joined: it resumes with or without the split."""
    m = _model(tiny_llama_factory)
    om = offload_model(m, AdamW(m.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "a", prefetch=1, device=compute_device)
    assert any(u.layout.pieces for u in om.mem.units)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(6)]
    for ids in batches[:3]:
        om.train_step(causal_lm_loss, [ids], LR)
    save_units(om, tmp_path / "ckpt")
    rest = [om.train_step(causal_lm_loss, [ids], LR) for ids in batches[3:]]
    final = om.mem.state(0, "exp_avg_sq")
    om.close()

    whole = _unpieced(_model(tiny_llama_factory), tmp_path / "b", compute_device)
    load_units(whole, tmp_path / "ckpt")
    assert all(torch.equal(want, whole.train_step(causal_lm_loss, [ids], LR)) for want, ids in zip(rest, batches[3:]))
    assert torch.equal(whole.mem.state(0, "exp_avg_sq"), final)
    save_units(whole, tmp_path / "ckpt_whole")
    whole.close()

    m2 = _model(tiny_llama_factory)
    again = offload_model(m2, AdamW(m2.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                          swap_dir=tmp_path / "c", prefetch=1, device=compute_device)
    load_units(again, tmp_path / "ckpt_whole")
    assert torch.equal(again.mem.state(0, "exp_avg_sq"), final)
    again.close()


def test_only_elementwise_optimizers_split(tiny_llama_factory):
    """A projection method's update mixes elements: its state is never split."""
    from outcore.offload.engine import causal_lm_units

    m = _model(tiny_llama_factory)
    units = causal_lm_units(m)
    assert state_pieces(units[0], AdamW(m.parameters()), 64 << 10) is not None
    assert state_pieces(units[0], GaLore(m.parameters(), rank=4), 64 << 10) is None
    assert state_pieces(units[0], AdamW(m.parameters()), 64 << 20) is None  # already small enough
    block = state_pieces(units[1], AdamW(m.parameters()), 1024)  # a block: its tensors in order
    assert [k for p in block.pieces for k, _, _ in p.segments] == sorted(
        k for p in block.pieces for k, _, _ in p.segments)
    assert {k for p in block.pieces for k, _, _ in p.segments} == set(range(len(units[1].slots)))


def test_pieced_adamw8bit_is_bit_identical(tiny_llama_factory, tmp_path, compute_device):
    """8-bit moments: pieces start on quantization-block boundaries, so each block's absmax
    is the same as when the tensor is updated whole."""
    from outcore.optim import AdamW8bit

    ref, ooc = _model(tiny_llama_factory).to(compute_device), _model(tiny_llama_factory)
    opt = AdamW8bit(ref.parameters(), lr=LR, weight_decay=WD)
    om = offload_model(ooc, AdamW8bit(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, device=compute_device)
    assert len(om.mem.units[0].layout.pieces) >= 2 and "m_absmax" in om.mem.units[0].layout.ratios
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (2, 24), generator=g)
        assert torch.equal(reference_step(ref, opt, [ids], 0.0), om.train_step(causal_lm_loss, [ids], LR))
    state = opt.state[ref.model.embed_tokens.weight]
    for kind in ("m_codes", "m_absmax", "v_codes", "v_absmax"):
        assert torch.equal(om.mem.state(0, kind)[:state[kind].numel()], state[kind].view(-1).cpu()), kind
    om.close()


def test_pieced_spill_with_accumulation_is_bit_identical(tiny_llama_factory, tmp_path, compute_device):
    """Two micro-batches: the second adds each spilled piece into its gradient (old + new) before
    the norm is taken on the whole; then each piece is clipped and updated."""
    ref, ooc = _model(tiny_llama_factory).to(compute_device), _model(tiny_llama_factory)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=0.5, grad_accum=2,
                       device=compute_device)
    assert om.spill and any(u.layout.pieces for u in om.mem.units)
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        micro = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(2)]
        want = reference_step(ref, opt, micro, 0.5)
        assert torch.equal(want, om.train_step(causal_lm_loss, micro, LR))
    params = dict(ref.named_parameters())
    for unit in om.units:
        for name, w in unit_weights(om, unit).items():
            assert torch.equal(w, params[name].detach().cpu()), name
    assert not any(part.kind == "g" for u in om.mem.units for part in u.memory.spilled)  # spilled pieces dropped
    om.close()


def _moe_model(seed=0):
    """A Qwen3-MoE whose middle block is mixture-of-experts (8 experts) between dense ones
    (``mlp_only_layers``): its state dwarfs theirs, so it streams in pieces."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0, 2], use_cache=False,
                         output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).train()


def _integer_histc_as_on_cuda(monkeypatch):
    """A gap of the simulated accelerator: off the CPU, transformers' MoE counts tokens per expert
    (experts and router loss) with an integer ``torch.histc``, which CUDA has; the simulator runs
    the CPU's kernel, which takes floats only. Here integers are counted as floats and the counts
    returned in their dtype, as CUDA's kernel returns them (the same counts: small integers)."""
    histc = torch.histc

    def integer_histc(x, *args, **kw):
        return histc(x, *args, **kw) if x.is_floating_point() else histc(x.float(), *args, **kw).to(x.dtype)
    monkeypatch.setattr(torch, "histc", integer_histc)


@pytest.mark.parametrize("clip,spill", [(0.0, False), (1.0, True)])
def test_pieced_moe_block_is_bit_identical(tmp_path, clip, spill, compute_device, monkeypatch):
    """A mixture-of-experts block (fused experts, router, attention, norms: many tensors) is a
    unit like any other: its state streams in pieces that cut across its tensors, bit-identical."""
    if compute_device.type == "sim":
        _integer_histc_as_on_cuda(monkeypatch)
    ref, ooc = _moe_model().to(compute_device), _moe_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, max_grad_norm=clip, spill_grads=spill,
                       device=compute_device)
    moe = om.mem.units[2]
    assert moe.name == "block.1" and len(moe.layout.pieces) >= 3 and not om.mem.units[1].layout.pieces
    assert any(len(p.segments) > 1 for p in moe.layout.pieces)  # a piece spans several of its tensors
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        assert torch.equal(reference_step(ref, opt, [ids], clip), om.train_step(causal_lm_loss, [ids], LR))
    params = dict(ref.named_parameters())
    for unit in om.units:
        for name, w in unit_weights(om, unit).items():
            assert torch.equal(w, params[name].detach().cpu()), name
    for k, slot in enumerate(moe.slots):  # each tensor's state, and its step advanced once per step
        state = opt.state[params[slot.name]]
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            s = moe.layout.states[k][kind]
            got = om.mem.state(moe.index, kind)[s.offset:s.offset + s.shape.numel()].view(s.shape)
            assert torch.equal(got, state[kind].view(s.shape).cpu()), (slot.name, kind)
    om.close()


@pytest.mark.parametrize("which", ["moe", "untied"])
def test_the_plan_pieces_what_the_engine_pieces(tiny_llama_factory, tmp_path, which):
    """The planner marks the same units as streaming their state in pieces as the engine does."""
    from outcore.planner.sizes import model_spec, unit_bytes

    model = _moe_model() if which == "moe" else _model(tiny_llama_factory, tie=False)
    planned = [u.state_piece > 0 for u in unit_bytes(model_spec(model), method="full", optim="adamw",
                                                      dtype="float32")]
    om = offload_model(model, AdamW(model.parameters(), lr=LR), offload="nvme", swap_dir=tmp_path / "swap",
                       prefetch=1)
    assert planned == [bool(u.layout.pieces) for u in om.mem.units] and any(planned)
    om.close()


def test_blocks_stream_in_pieces_under_the_piece_cap(tiny_llama_factory, tmp_path, monkeypatch, compute_device):
    """Pieces are at most ``MAX_PIECE_BYTES`` (an 8B block's 1.23 GiB of state would otherwise
    be three times the HOST window): under it every unit streams in pieces, blocks included,
    with bf16 weights and fp32 masters, an untied embedding's row gradient and untied head —
    bit-identical to the same run with the state whole."""
    monkeypatch.setattr(unit_sizes, "MAX_PIECE_BYTES", 16 << 10)
    runs = []
    for cap in (True, False):
        if not cap:
            monkeypatch.setattr(unit_sizes, "MAX_PIECE_BYTES", 1 << 40)
        m = _model(tiny_llama_factory, tie=False, dtype=torch.bfloat16)
        om = offload_model(m, AdamW(m.parameters(), lr=LR, weight_decay=WD), offload="nvme",
                           swap_dir=tmp_path / f"swap{cap}", prefetch=1, device=compute_device)
        assert all(bool(u.layout.pieces) == cap for u in om.mem.units[1:-1]), "blocks pieced only under the cap"
        g = torch.Generator().manual_seed(2)
        losses = [om.train_step(causal_lm_loss, [torch.randint(0, VOCAB, (2, 24), generator=g)], LR) for _ in range(4)]
        runs.append((losses, [unit_weights(om, u) for u in om.units], om.mem.state(1, "master")))
        om.close()
    (la, wa, ma), (lb, wb, mb) = runs
    assert all(torch.equal(a, b) for a, b in zip(la, lb)) and torch.equal(ma, mb)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(wa, wb) for n in a)


def test_device_window_never_holds_an_untied_embedding_and_head_at_once():
    """The DEVICE window is the 2k + 2 consecutive units of the step that take most, with what
    they borrow: untied, the embedding and the head are far apart; tied, the head borrows
    the embedding; a model too shallow for the window holds both."""
    untied = [10, 1, 1, 1, 1, 1, 10]
    assert step_window(untied, 4, [[]] * 7) == 13
    assert step_window([10, 1, 1, 1, 1, 1, 0], 4, [[]] * 6 + [[0]]) == 13  # the tied head: embed + 3 blocks
    assert step_window([10, 1, 10], 4, [[]] * 3) == 21
