"""Every activation policy gives fp32 gradients bit-identical to KEEP on a tiny Llama."""
from __future__ import annotations

import gc

import pytest
import torch

from outcore.activations import ActivationPolicy as P
from outcore.activations import apply_activation_policy, find_decoder_layers
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
                                    ["offload_nvme", "recompute", "offload_host", "keep"]])
def test_policy_is_bit_identical_to_keep(model, policy):
    ids = _ids()
    ref = _step(model, ids)
    handle = apply_activation_policy(model, policy)
    if handle.offloader is not None:
        handle.offloader.min_bytes = 0  # offload everything that is not a parameter
    try:
        got = _step(model, ids)
        again = _step(model, ids)  # a second step reuses the machinery
    finally:
        handle.remove()
    assert _same(got, ref) and _same(again, ref)
    if handle.policies and any(p.offloads for p in handle.policies):
        assert handle._store is not None


def test_offload_moves_bytes_and_frees_them(model, tmp_path):
    from outcore.offload import Tier, TieredStore

    ids = _ids()
    with TieredStore(device_bytes=0, host_bytes=8 << 20, swap_dir=tmp_path / "swap") as store:
        handle = apply_activation_policy(model, [P.OFFLOAD_NVME, P.OFFLOAD_HOST, P.OFFLOAD_NVME, P.KEEP],
                                         store=store)
        off = handle.offloader
        off.min_bytes = 0
        prefetched = []
        restore = off._restore
        off._restore = lambda s: (prefetched.append(s.read is not None), restore(s))[1]
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        assert off.stats["offloaded_bytes"] > 0 and off.stats["tensors"] > 0
        loss.backward()
        stats = store.tier_stats()
        assert stats["NVME"].written_bytes > 0  # (store.load does not count its reads yet)
        assert store.handles == []  # every offloaded tensor was read back and unregistered
        assert prefetched and sum(prefetched) >= 0.9 * len(prefetched)  # read ahead, not on demand
        # A graph dropped without backward frees its stored bytes too.
        loss = model(input_ids=ids, labels=ids).loss
        del loss
        gc.collect()
        off._writer.submit(lambda: None).result()
        store.synchronize()
        assert store.handles == [] and store.held(Tier.HOST) == 0
        handle.remove()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_no_grad_and_eval_do_not_offload(model):
    handle = apply_activation_policy(model, "offload")
    with torch.no_grad():
        model(input_ids=_ids())
    assert handle.offloader.stats["tensors"] == 0
    handle.remove()


def test_composes_with_outer_saved_tensor_hooks(model):
    ids = _ids()
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


def test_auto_measures_then_chooses(model):
    ids = _ids()
    ref = _step(model, ids)
    handle = apply_activation_policy(model, "auto", device_budget=1_500_000)
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
    with pytest.raises(ConfigError, match="nvme_speed"):
        apply_activation_policy(model, "auto", nvme_speed=1.0)
    handle = apply_activation_policy(model, "recompute")
    with pytest.raises(ModelError, match="remove"):
        apply_activation_policy(model, "keep")
    handle.remove()


@pytest.mark.gpu
def test_offload_on_cuda_is_bit_identical(tiny_llama_factory):
    model = tiny_llama_factory().cuda().train()
    ids = _ids().cuda()
    ref = _step(model, ids)
    handle = apply_activation_policy(model, ["offload_nvme", "offload_host", "recompute", "keep"])
    handle.offloader.min_bytes = 0
    try:
        got = _step(model, ids)
    finally:
        handle.remove()
    assert _same(got, ref)
