"""Every activation policy gives fp32 gradients bit-identical to KEEP on a tiny Llama."""
from __future__ import annotations

import gc
import time

import pytest
import torch
from outcore.activations import ActivationPolicy as P
from outcore.activations import apply_activation_policy, find_decoder_layers
from outcore.activations.pack import BlockPack
from outcore.errors import ConfigError, ModelError


@pytest.fixture
def model(tiny_llama):
    tiny_llama.train()
    for layer in tiny_llama.model.layers:  # dropout: recompute must replay the same RNG draws
        layer.self_attn.attention_dropout = 0.1
    return tiny_llama


def _step(model, ids, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _ids():
    return torch.randint(3, 256, (2, 48), generator=torch.Generator().manual_seed(1))


def _same(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("policy", ["recompute", "offload", "offload_host", "offload_nvme",
                                    ["offload_nvme", "recompute", "offload_host", "keep"],
                                    ["offload_nvme", "offload_host", "recompute", "keep"]])
def test_policy_is_bit_identical_to_keep(model, policy, compute_device):
    """On the compute device: KEEP in memory there is the reference (a GPU's bits are its own)."""
    model.to(compute_device)
    ids = _ids().to(compute_device)
    ref = _step(model, ids)
    handle = apply_activation_policy(model, policy, min_bytes=0)  # offload all but parameters
    try:
        got = _step(model, ids)
        again = _step(model, ids)  # a second step reuses the machinery (and the pooled buffers)
    finally:
        handle.remove()
    assert _same(got, ref) and _same(again, ref)
    if any(p.offloads for p in handle.policies):
        assert handle._store is not None


def test_offload_moves_bytes_once_per_block_and_frees_them(model, tmp_path):
    from outcore.offload import Tier, TieredStore

    ids = _ids()
    with TieredStore(device_bytes=0, host_bytes=8 << 20, swap_dir=tmp_path / "swap") as store:
        handle = apply_activation_policy(model, [P.OFFLOAD_NVME, P.OFFLOAD_HOST, P.OFFLOAD_NVME, P.KEEP],
                                         store=store, min_bytes=0)
        off = handle.offloader
        prefetched = []
        restore = off._restore
        off._restore = lambda rec, ref: (prefetched.append(rec.read is not None or rec.base is not None),
                                         restore(rec, ref))[1]
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        assert off.stats["blocks"] == 3 and off.stats["tensors"] > 3
        # aliases (q/k/v share their input, views share storage) are moved once
        assert 0 < off.stats["offloaded_bytes"] < off.stats["saved_bytes"]
        off._copier.submit(lambda: None).result()
        for _ in range(200):  # the writes complete on I/O threads
            if store.nvme.written_bytes:
                break
            time.sleep(0.01)
        written = store.nvme.written_bytes
        loss.backward()
        assert 0 < written <= 2 * (off.stats["offloaded_bytes"] + (8 << 10))  # one 4 KiB-padded extent per block
        nvme = store.tier_stats()["NVME"]  # what the dashboard shows: activations' bytes counted too
        assert nvme.written_bytes == store.nvme.written_bytes > 0 and nvme.read_bytes == store.nvme.read_bytes > 0
        assert store.held(Tier.NVME) == 0 and store.held(Tier.HOST) == 0  # read back and freed
        assert prefetched and all(prefetched)  # read ahead by the backward hooks, not on demand
        # A graph dropped without backward frees its stored bytes too.
        loss = model(input_ids=ids, labels=ids).loss
        del loss
        gc.collect()
        off._copier.submit(lambda: None).result()
        for _ in range(200):
            if store.held(Tier.NVME) == 0 and store.held(Tier.HOST) == 0:
                break
            time.sleep(0.01)
        assert store.held(Tier.NVME) == 0 and store.held(Tier.HOST) == 0 and store.handles == []
        handle.remove()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_pooled_buffers_are_reused_across_steps(model):
    ids = _ids()
    handle = apply_activation_policy(model, "offload_nvme", min_bytes=0)
    try:
        _step(model, ids)
        live = handle.offloader.pool.live_bytes
        assert live > 0
        _step(model, ids)
        _step(model, ids)
        assert handle.offloader.pool.live_bytes == live  # no new buffer after the first step
    finally:
        handle.remove()
    assert handle.offloader is None


def test_small_tensors_and_parameters_stay(model, monkeypatch):
    ids = _ids()
    handle = apply_activation_policy(model, "offload_nvme", min_bytes=1 << 40)
    try:
        _step(model, ids)
        assert handle.offloader.stats["tensors"] == 0 and handle.offloader.stats["kept_bytes"] > 0
    finally:
        handle.remove()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    added = []
    orig = BlockPack.add
    monkeypatch.setattr(BlockPack, "add",
                        lambda self, t: (added.append(t.untyped_storage().data_ptr()), orig(self, t))[1])
    handle = apply_activation_policy(model, "offload_nvme", min_bytes=0)
    try:
        _step(model, ids)
    finally:
        handle.remove()
    assert added and not params.intersection(added)


def test_last_blocks_stay_kept(model):
    n = len(model.model.layers)
    handle = apply_activation_policy(model, "offload", keep_last=2, min_bytes=0)
    try:
        assert handle.policies == [P.OFFLOAD_NVME] * (n - 2) + [P.KEEP] * 2
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        assert handle.offloader.stats["blocks"] == n - 2
    finally:
        handle.remove()


def test_nvme_budget_too_small_fails_in_the_forward(model, tmp_path):
    from outcore.errors import BudgetError
    from outcore.offload import TieredStore

    with TieredStore(device_bytes=0, host_bytes=0, nvme_bytes=4096, swap_dir=tmp_path / "swap") as store:
        handle = apply_activation_policy(model, "offload_nvme", store=store, min_bytes=0)
        try:
            with pytest.raises(BudgetError, match=r"NVME tier budget 0.0 MiB cannot hold the activations "
                                                  r"of block 0"):
                model(input_ids=_ids(), labels=_ids())
        finally:
            handle.remove()


def test_host_budget_too_small_is_reported(model, tmp_path):
    from outcore.errors import BudgetError
    from outcore.offload import TieredStore

    with TieredStore(device_bytes=0, host_bytes=4096, swap_dir=tmp_path / "swap") as store:
        handle = apply_activation_policy(model, "offload_host", store=store, min_bytes=0)
        try:
            with pytest.raises(BudgetError, match="HOST tier budget"):
                model(input_ids=_ids(), labels=_ids()).loss.backward()
        finally:
            handle.remove()


def test_no_grad_and_eval_do_not_offload(model):
    handle = apply_activation_policy(model, "offload")
    with torch.no_grad():
        model(input_ids=_ids())
    assert handle.offloader.stats["tensors"] == 0
    handle.remove()


def test_composes_with_outer_saved_tensor_hooks(model, compute_device):
    model.to(compute_device)
    ids = _ids().to(compute_device)
    ref = _step(model, ids)
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    handle = apply_activation_policy(model, "offload")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = _step(model, ids)
    finally:
        handle.remove()
    assert _same(got, ref)
    assert seen  # kept tensors (parameters, small ones) still reach the outer hook


def test_auto_measures_then_chooses(model, compute_device):
    model.to(compute_device)
    ids = _ids().to(compute_device)
    ref = _step(model, ids)
    handle = apply_activation_policy(model, "auto", device_budget=1_500_000, min_bytes=0)
    try:
        first = _step(model, ids)  # measured, everything kept
        assert handle.profiles is not None and all(p.saved_bytes > 0 for p in handle.profiles)
        assert handle.policies[-1] is P.KEEP and any(p is not P.KEEP for p in handle.policies)
        second = _step(model, ids)  # with the chosen policies
    finally:
        handle.remove()
    assert _same(first, ref) and _same(second, ref)


def test_bad_inputs(model):
    with pytest.raises(ModelError, match="Linear"):
        apply_activation_policy(torch.nn.Linear(2, 2), "keep")
    with pytest.raises(ModelError, match="Linear"):
        find_decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="'sideways'"):
        apply_activation_policy(model, "sideways")
    with pytest.raises(ConfigError, match="min_bytes=-1"):
        apply_activation_policy(model, "offload", min_bytes=-1)
    with pytest.raises(ConfigError, match="keep_last=-1"):
        apply_activation_policy(model, "offload", keep_last=-1)
    with pytest.raises(ConfigError, match="nvme_speed"):
        apply_activation_policy(model, "auto", nvme_speed=1.0)
    handle = apply_activation_policy(model, "recompute")
    with pytest.raises(ModelError, match="remove"):
        apply_activation_policy(model, "keep")
    handle.remove()


class _InPlaceBlock(torch.nn.Module):
    """Saves ``h`` for backward (through ``h * w``), then changes ``h`` in place."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(64))

    def forward(self, x):
        h = x + 1
        y = h * self.w
        h.mul_(2)
        return y


def test_in_place_change_of_a_saved_tensor_is_an_error_as_without_offload():
    toy = torch.nn.Module()
    toy.layers = torch.nn.ModuleList([_InPlaceBlock(), _InPlaceBlock()])
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        toy.layers[1](toy.layers[0](x)).sum().backward()  # plain autograd refuses
    handle = apply_activation_policy(toy, ["offload_nvme", "keep"], min_bytes=0)
    try:
        with pytest.raises(RuntimeError, match="modified (by an inplace operation|in place)"):
            toy.layers[1](toy.layers[0](x)).sum().backward()  # never the changed values
    finally:
        handle.remove()


def test_idle_pool_gives_its_pages_back_and_keeps_its_buffers():
    """Through the loss the pool's free buffers hold no memory (their pages read back as zeros),
    nor do buffers given back until the next take; the buffers themselves are reused."""
    from outcore.activations.offload import BufferPool
    from outcore.offload.aligned import aligned_empty

    pool = BufferPool(aligned_empty, keep=2, can_discard=True)
    a, b = pool.take(1 << 20), pool.take(1 << 20)
    a.fill_(5)
    b.fill_(6)
    pool.give(a)
    pool.idle()
    assert int(a.sum()) == 0  # discarded: fresh zero pages on the next touch
    pool.give(b)  # given back while idle: discarded too
    assert int(b.sum()) == 0
    live = pool.live_bytes
    c = pool.take(1 << 20)  # reused, not a new buffer
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr()) and pool.live_bytes == live
    c.fill_(7)
    pool.give(c)  # not idle any more: kept as it is
    assert int(c[:8].sum()) == 56
    pinned = BufferPool(aligned_empty, keep=1)  # pinned (CUDA) pools never discard
    d = pinned.take(1 << 20)
    d.fill_(1)
    pinned.give(d)
    pinned.idle()
    assert int(d[:8].sum()) == 8
