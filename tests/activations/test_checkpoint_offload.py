"""Block checkpoints offloaded (``recompute_host`` / ``recompute_nvme``): every block recomputed
in the backward from its input hidden state, which waits on HOST or NVMe (through the store,
under its budget and counters) and is read back ahead; gradients bit-identical to KEEP."""
from __future__ import annotations

import pytest
import torch
from outcore.activations import ActivationPolicy as P
from outcore.activations import apply_activation_policy, expand_policy


@pytest.fixture
def model(tiny_llama):
    tiny_llama.train()
    for layer in tiny_llama.model.layers:  # dropout: the recompute must replay the same RNG draws
        layer.self_attn.attention_dropout = 0.1
    return tiny_llama


def _step(model, ids, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _ids(seq=48):
    return torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(1))


def test_names_expand_to_offloaded_checkpoints_but_the_last_blocks():
    assert expand_policy("recompute_nvme", 4, keep_last=1) == [P.RECOMPUTE_NVME] * 3 + [P.RECOMPUTE]
    assert expand_policy("recompute_host", 3, keep_last=2) == [P.RECOMPUTE_HOST] + [P.RECOMPUTE] * 2
    assert all(p.recomputes and p.offloads for p in (P.RECOMPUTE_HOST, P.RECOMPUTE_NVME))
    assert P.RECOMPUTE_HOST.to_host and not P.RECOMPUTE_NVME.to_host and not P.RECOMPUTE.offloads


@pytest.mark.parametrize("policy", ["recompute_nvme", "recompute_host", [P.RECOMPUTE_NVME, P.RECOMPUTE_HOST,
                                                                          P.OFFLOAD_NVME, P.KEEP]])
@pytest.mark.parametrize("seq_tile", [0, 32])
def test_bit_identical_to_keep(model, policy, seq_tile, compute_device):
    model.to(compute_device)
    ids = _ids().to(compute_device)
    keep = apply_activation_policy(model, "keep", seq_tile=seq_tile)
    ref = _step(model, ids)
    keep.remove()
    handle = apply_activation_policy(model, policy, min_bytes=0, seq_tile=seq_tile)
    try:
        got, again = _step(model, ids), _step(model, ids)
    finally:
        handle.remove()
    for a in (got, again):
        assert torch.equal(a[0], ref[0]) and all(torch.equal(x, y) for x, y in zip(a[1], ref[1]))


def test_only_the_checkpoint_moves_through_the_store(model, tmp_path):
    from outcore.offload import Tier, TieredStore

    ids = _ids(seq=64)
    hidden = ids.numel() * model.config.hidden_size * 4  # one block's input, fp32
    with TieredStore(device_bytes=0, host_bytes=0, swap_dir=tmp_path / "swap") as store:
        handle = apply_activation_policy(model, "recompute_nvme", store=store, min_bytes=0)
        try:
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            stats = handle.offloader.stats
            n = len(model.model.layers) - 1  # the last block's checkpoint stays (keep_last=1)
            assert stats["blocks"] == n and stats["tensors"] == n
            assert stats["offloaded_bytes"] == stats["saved_bytes"] == n * hidden
            loss.backward()
            handle.offloader._copier.submit(lambda: None).result()
            assert store.nvme.written_bytes >= n * hidden and store.nvme.read_bytes >= n * hidden
            assert store.held(Tier.NVME) == 0  # read back and freed
        finally:
            handle.remove()
