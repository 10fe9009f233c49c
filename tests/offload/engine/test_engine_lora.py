"""LoRA through the out-of-core engine: the frozen base streams read-only, adapters stay resident."""
from __future__ import annotations

import copy

import pytest
import torch

from outcore.offload.engine import Part, offload_model
from outcore.recipes.export import export_offloaded, unit_weights
from tests._helpers import causal_lm_loss, reference_step

LR = 1e-3


def _lora_pair(factory, layers=4):
    from peft import LoraConfig, get_peft_model

    base = factory(seed=0, layers=layers)
    base.config.use_cache = False
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(3)
    ref = get_peft_model(base, cfg)
    for name, p in ref.named_parameters():  # B starts at zero: give the adapters a real delta
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return ref.train(), copy.deepcopy(ref).train()


def _adapters(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("clip,recompute", [(0.0, False), (1.0, True)])
def test_lora_streamed_equals_in_memory(tiny_llama_factory, tmp_path, clip, recompute, compute_device):
    ref, ooc = _lora_pair(tiny_llama_factory)
    ref.to(compute_device)  # in memory on the device; the engine places ooc's resident adapters there
    opt_ref = torch.optim.AdamW(_adapters(ref).values(), lr=LR, fused=True)
    opt = torch.optim.AdamW(_adapters(ooc).values(), lr=LR, fused=True)
    block = sum(p.numel() * 4 for p in ooc.base_model.model.model.layers[0].parameters() if not p.requires_grad)
    om = offload_model(ooc, opt, offload="nvme", swap_dir=tmp_path / "swap", prefetch=1,
                       max_grad_norm=clip, device_bytes=3 * block + 64 * 1024, resident_trainable=True,
                       device=compute_device)
    if recompute:
        from outcore.activations import apply_activation_policy
        apply_activation_policy(ooc.get_base_model(), "recompute")
        apply_activation_policy(ref.get_base_model(), "recompute")
    # only frozen base weights live in the store; the adapters are the model's own tensors
    assert all(not s.param.requires_grad for u in om.units for s in u.slots)
    assert all(p.numel() > 0 for p in _adapters(ooc).values())
    written0 = om.tier_stats()["NVME"].written_bytes
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.randint(0, 256, (2, 24), generator=g)
        loss = reference_step(ref, opt_ref, [ids], clip)  # clips the adapters: the trainable ones
        got = om.train_step(causal_lm_loss, [ids], LR)
        assert torch.equal(loss.detach(), got)
    for name, p in _adapters(ref).items():
        assert torch.equal(p.detach(), _adapters(ooc)[name].detach()), name
    stats = om.tier_stats()
    assert stats["NVME"].read_bytes > 0  # the base really streamed from disk
    assert stats["NVME"].written_bytes == written0  # ... and was never written back
    om.close()


def test_lora_export_merges_adapters(tiny_llama_factory, tmp_path, compute_device):
    from transformers import AutoModelForCausalLM

    ref, ooc = _lora_pair(tiny_llama_factory, layers=2)
    om = offload_model(ooc, torch.optim.AdamW(_adapters(ooc).values(), lr=LR), offload="cpu",
                       swap_dir=None, resident_trainable=True, device=compute_device)
    out = export_offloaded(om, ooc, tmp_path / "final")
    om.close()
    merged = ref.merge_and_unload()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want = merged.state_dict()
    for name, t in loaded.state_dict().items():
        torch.testing.assert_close(t, want[name], rtol=0, atol=1e-6, msg=name)


def test_mixing_streamed_and_resident_trainables_is_refused(tiny_llama_factory, tmp_path):
    from outcore.offload.engine import causal_lm_units

    from outcore.offload.engine import OutOfCoreEngine

    model = tiny_llama_factory(seed=0, layers=2)
    units = causal_lm_units(model)
    units[1].slots = units[1].slots[:1]  # one block's other parameters left out of every unit
    with pytest.raises(ValueError, match="streamed and some resident"):
        OutOfCoreEngine(model, torch.optim.AdamW(model.parameters()), lambda u, o: None, units=units)


def test_qlora_streams_nf4_and_equals_the_dequantized_reference(tiny_llama_factory, tmp_path, compute_device,
                                                                 monkeypatch):
    """QLoRA out of core: the blocks' frozen matrices stream as NF4 (bitsandbytes' codes) and are
    dequantized on fetch; training equals in-memory LoRA on the NF4-rounded base, bit for bit."""
    from outcore.offload.engine.nf4 import nf4_round_trip

    if compute_device.type == "sim":
        # bitsandbytes has no kernels for the simulated accelerator: its default backend runs
        # torch.compile'd torch ops, ~0.1 s a call there (100x the test's time); eager, the same bits
        monkeypatch.setattr(torch._dynamo.config, "disable", True)

    ref, ooc = _lora_pair(tiny_llama_factory)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".layers." in name and p.dim() == 2 and not p.requires_grad:
                p.copy_(nf4_round_trip(p, p.dtype))
    ref.to(compute_device)  # rounded on the CPU by bitsandbytes: the engine encodes on the CPU too
    opt_ref = torch.optim.AdamW(_adapters(ref).values(), lr=LR, fused=True)
    om = offload_model(ooc, torch.optim.AdamW(_adapters(ooc).values(), lr=LR, fused=True), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, resident_trainable=True, quantize_frozen=True,
                       device=compute_device)
    block = om.units[1]
    fp32_bytes = block.numel * 4
    assert om.mem.units[1].layout.handles[Part("w")].dtype == torch.uint8
    assert om.mem.units[1].layout.handles[Part("w")].nbytes < 0.2 * fp32_bytes  # ~0.56 of 4 bytes per weight
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        ids = torch.randint(0, 256, (2, 24), generator=g)
        loss = reference_step(ref, opt_ref, [ids], 0.0)
        assert torch.equal(loss.detach(), om.train_step(causal_lm_loss, [ids], LR))
    for name, p in _adapters(ref).items():
        assert torch.equal(p.detach(), _adapters(ooc)[name].detach()), name
    names = dict(ref.named_parameters())
    for name, w in unit_weights(om, block).items():  # what the store decodes is the reference's base
        assert torch.equal(w, names[name].detach().cpu()), name
    om.close()


def test_nf4_decodes_a_few_rows_at_a_time_to_the_same_bits(tiny_llama_factory, monkeypatch):
    """A matrix larger than ``DECODE_CHUNK`` is dequantized in slices of whole rows (no temporary
    the size of a 70B MLP matrix): the same values as bitsandbytes' whole-matrix round trip."""
    from outcore.offload.engine import nf4
    from outcore.offload.engine.units import causal_lm_units

    model = tiny_llama_factory(layers=1)
    for p in model.parameters():
        p.requires_grad_(False)
    block = causal_lm_units(model)[1]
    layout = nf4.NF4Layout(block, torch.float32)
    raw = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for k, slot in enumerate(block.slots):
        layout.encode(k, slot.param.data, raw)
    monkeypatch.setattr(nf4, "DECODE_CHUNK", 3 * 64)  # 3 rows of 64 columns: slices end mid-matrix
    flat = layout.decode(raw, torch.empty(block.numel))
    for slot in block.slots:
        want = nf4.nf4_round_trip(slot.param.data, torch.float32) if slot.param.dim() == 2 else slot.param.data
        assert torch.equal(block.view(flat, slot), want), slot.name


def test_a_released_block_lends_its_dequantized_buffer_unless_still_viewed(tiny_llama_factory, tmp_path):
    """A quantized block is dequantized into the buffer the last released one used (no fresh
    pages to fault in), but never while a tensor still views it (a checkpointed block's saved
    tensors can outlive its release)."""
    _, ooc = _lora_pair(tiny_llama_factory, layers=2)
    om = offload_model(ooc, torch.optim.AdamW(_adapters(ooc).values(), lr=LR), offload="nvme",
                       swap_dir=tmp_path / "swap", prefetch=1, resident_trainable=True, quantize_frozen=True)
    mem, w = om.mem, Part("w")
    first = mem.acquire(1, w)
    want, ptr = first.clone(), first.data_ptr()
    del first
    mem.release(1, w, dirty=False)
    second = mem.acquire(2, w)
    assert second.data_ptr() == ptr  # block 1's buffer, reused
    held = second[:8]  # what a saved tensor would keep
    del second
    mem.release(2, w, dirty=False)
    again = mem.acquire(1, w)
    assert again.data_ptr() != ptr and held.data_ptr() == ptr
    assert torch.equal(again, want)
    del again
    mem.release(1, w, dirty=False)
    om.close()
