"""The GPU path, checked on the simulated accelerator (and on a GPU where there is one).

Each test here names the mistake it guards against: the ways the code once would have
failed on a device — CPU batches or buffers meeting device weights, updates mixing
device weights with host state, copies racing the compute stream, staging copies that
filled the HOST tier, pinned slabs rounded up and never released. On the CPU the same
tests run with the RAM arena as the DEVICE tier, so both paths stay equivalent.
"""
from __future__ import annotations

import gc

import pytest
import torch

from outcore.offload.aligned import align_up

from outcore.offload.device import Device, is_accelerator
from outcore.offload.engine import WEIGHTS, offload_model
from outcore.offload.store import Tier, TieredStore
from outcore.optim import AdamW
from tests._helpers import causal_lm_loss


def _model(factory, layers=2, **kw):
    m = factory(seed=0, layers=layers, **kw)
    m.config.use_cache = False
    return m.train()


def test_engine_places_what_no_unit_streams(tiny_llama_factory, tmp_path, compute_device):
    """Buffers computed at load (RoPE's frequencies) and resident adapters compute beside the
    streamed weights: on the device, and the parameters' placeholders too."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(tiny_llama_factory), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = [p for p in model.parameters() if p.requires_grad]
    om = offload_model(model, torch.optim.AdamW(adapters, lr=1e-3), offload="cpu", swap_dir=None,
                       resident_trainable=True, device=compute_device)
    try:
        assert all(p.device == compute_device for p in model.parameters())  # adapters and placeholders
        assert all(b.device == compute_device for b in model.buffers())
        loss = om.train_step(causal_lm_loss, [torch.randint(0, 256, (2, 16))], 1e-3)  # CPU ids: moved by the engine
        assert loss.device == compute_device and torch.isfinite(loss).item()
    finally:
        om.close()


def test_the_update_runs_where_its_weights_are(tiny_llama_factory, tmp_path, compute_device):
    """On an accelerator the optimizer state is used in DEVICE memory beside the weights (an
    update mixing device weights with HOST state fails there); on a CPU in the HOST tier."""
    om = offload_model(_model(tiny_llama_factory), AdamW(_model(tiny_llama_factory).parameters(), lr=1e-3),
                       offload="nvme", swap_dir=tmp_path / "swap", device=compute_device)
    try:
        om.train_step(causal_lm_loss, [torch.randint(0, 256, (2, 16))], 1e-3)
        want = Tier.DEVICE if is_accelerator(compute_device) else Tier.HOST
        state = [p for p in om.units[1].layout.handles if p.kind != WEIGHTS]
        assert state and all(om.mem._tier(p) is want for p in state)
    finally:
        om.close()


def test_copies_into_device_memory_wait_for_the_compute_that_read_it(compute_device):
    """A slot freed after compute read it may be refilled at once: the copy stream must wait
    for that compute (the simulated accelerator's race detector raises otherwise)."""
    if not is_accelerator(compute_device):
        pytest.skip("a CPU computes as it is called: nothing is queued behind a copy")
    dev = Device(compute_device)
    try:
        slab = dev.alloc_device_slab(1 << 16)
        slab.fill_(1)
        read = slab[:4096].float().sum()  # compute reads the slot (queued on a GPU)
        dev.note_free()  # the slot goes back to the arena
        host = dev.alloc_host_slab(4096)
        host.fill_(2)
        dev.copy_async(slab[:4096], host).result()
        assert read.item() == 4096 and torch.equal(slab[:4096].cpu(), host)
    finally:
        dev.close()


def test_a_copy_that_skips_the_free_event_is_caught(compute_device):
    """The control of the test above: without the compute event recorded at the free, the
    simulated accelerator reports the race (a real GPU would silently corrupt the slot)."""
    if compute_device.type != "sim":
        pytest.skip("only the simulated accelerator detects a stream race")
    dev = Device(compute_device)
    try:
        slab = dev.alloc_device_slab(1 << 16)
        slab.fill_(1)
        slab[:4096].float().sum()
        host = dev.alloc_host_slab(4096)
        with pytest.raises(RuntimeError, match="race"):
            dev.copy_async(slab[:4096], host).result()  # no note_free(): nothing orders it
    finally:
        dev.close()


def test_staging_copies_leave_the_host_tier_when_they_land(tmp_path, compute_device):
    """Disk <-> device copies pass through pinned HOST memory on an accelerator; once a copy
    has landed its staging copy is freed, so a HOST tier of one tensor streams many."""
    n = 1 << 16
    with TieredStore(device_bytes=4 * n, host_bytes=n, swap_dir=tmp_path / "s", device=Device(compute_device)) as s:
        hs = [s.register(f"t{i}", data=torch.full((n // 4,), float(i))) for i in range(8)]
        for i, h in enumerate(hs):
            d = s.fetch(h, Tier.DEVICE).result()
            assert torch.equal(d.cpu(), torch.full((n // 4,), float(i)))
            d.add_(1)
            s.mark_dirty(h, Tier.DEVICE)
            s.release(h, Tier.DEVICE)
            s.evict(h, Tier.DEVICE).result()  # written home through HOST, then freed
            assert s.held(Tier.HOST) == 0
        assert all(torch.equal(s.load(h), torch.full((n // 4,), float(i + 1))) for i, h in enumerate(hs))


def test_pinned_host_slabs_are_their_own_size_and_unpinned_when_freed(compute_device):
    """torch's pinned allocator rounds a slab up to a power of two and keeps it for the process's
    life; registering our own aligned memory pins what was asked, until the slab is freed."""
    if not is_accelerator(compute_device):
        pytest.skip("no pinning on a CPU-only machine")
    dev = Device(compute_device)
    try:
        nbytes = 5 * (1 << 20) + 123
        slab = dev.alloc_host_slab(nbytes)
        assert slab.is_pinned() and slab.numel() == align_up(nbytes) and slab.data_ptr() % 4096 == 0
        view = slab[4096:8192]
        del slab
        gc.collect()
        assert view.is_pinned()  # a view keeps the slab, and its registration, alive
        ptr = view.data_ptr()
        assert _pinned_at(ptr)
        del view
        gc.collect()
        assert not _pinned_at(ptr)  # unregistered (and unmapped: only the address is asked about)
    finally:
        dev.close()


def _pinned_at(ptr: int) -> bool:
    """Does the device's runtime count the page at address ``ptr`` as pinned host memory?"""
    import ctypes

    return torch.frombuffer((ctypes.c_char * 1).from_address(ptr), dtype=torch.uint8).is_pinned()


def test_activation_auto_sizes_from_the_device_the_blocks_compute_on(tiny_llama_factory, compute_device):
    """Out of core the parameters are placeholders on the compute device: the activation
    policy takes that device (its free memory), not the CPU's RAM."""
    from outcore.activations import apply_activation_policy

    model = _model(tiny_llama_factory)
    om = offload_model(model, AdamW(model.parameters(), lr=1e-3), offload="cpu", swap_dir=None,
                       device=compute_device)
    try:
        handle = apply_activation_policy(model, "auto", device_budget=1 << 30)
        assert handle._device == compute_device
        handle.remove()
    finally:
        om.close()


def test_checkpoints_save_one_devices_rng_state():
    """A resume on a machine with another number of GPUs restores the state all the same."""
    from outcore.training import checkpoint as ckpt

    state = ckpt.rng_state(torch.device("cpu"))
    assert "cuda" not in state  # the CPU's generator is saved apart
    ckpt.set_rng_state(state, torch.device("cpu"))
    if torch.cuda.is_available():
        cuda = ckpt.rng_state(torch.device("cuda", 0))
        assert isinstance(cuda["cuda"], torch.Tensor)  # this device's, not a list of every GPU's
        ckpt.set_rng_state({**cuda, "cuda": [cuda["cuda"]]}, torch.device("cuda", 0))  # an older checkpoint's list


@pytest.mark.gpu
def test_device_memory_reports_the_current_gpu():
    from outcore.offload.device import device_memory

    index = torch.cuda.device_count() - 1
    torch.cuda.set_device(index)
    try:
        mem = device_memory()
        assert mem["device_total_bytes"] == torch.cuda.get_device_properties(index).total_memory
    finally:
        torch.cuda.set_device(0)


def test_a_large_units_state_streams_to_the_device_in_pieces(tiny_llama_factory, tmp_path, compute_device):
    """On an accelerator every unit's state streams to the update, from HOST as from NVMe: a unit
    whose state dwarfs a block's (an 8B embedding's 6 GiB) comes a block-sized piece at a time,
    or the DEVICE window holds it whole (on an H200 capped at 24 GiB, the 8B shape's did not fit)."""
    model = _model(tiny_llama_factory, layers=2, vocab=4096, tie=False)
    om = offload_model(model, AdamW(model.parameters(), lr=1e-3), offload="cpu", swap_dir=None, device=compute_device)
    try:
        embed_state = 2 * 4 * model.config.vocab_size * model.config.hidden_size  # two fp32 moments
        largest = max(h.nbytes for part, h in om.units[0].layout.handles.items() if part.kind != WEIGHTS)
        if is_accelerator(compute_device):
            assert om.units[0].layout.pieces and largest < embed_state / 4
        else:  # a CPU updates in HOST, where the state lives whole
            assert not om.units[0].layout.pieces
        loss = om.train_step(causal_lm_loss, [torch.randint(0, 4096, (2, 16))], 1e-3)
        assert torch.isfinite(loss).item()
    finally:
        om.close()
