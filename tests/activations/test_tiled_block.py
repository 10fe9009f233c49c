"""Sequence-tiled recomputed blocks (activations/tiled_block.py) against the untiled
checkpoint on a tiny Llama (fp32, SDPA).

The loss and the gradients differ from the untiled block by fp32 rounding (a tile's attention
merged from two calls, the sums that cross tiles added in another order): ~5e-7 of each
gradient's largest element here. Offloaded to NVMe == in memory, bit for bit; where a block
cannot be tiled (a padding mask) it is checkpointed whole. One tile's recompute saves a
tile's worth.
"""
from __future__ import annotations

import pytest
import torch

from outcore.activations import apply_activation_policy
from outcore.activations import tiled_block
from outcore.planner.sizes import block_activation_bytes, model_spec

TILE, SEQ = 128, 360  # three tiles, the last one partial


@pytest.fixture(scope="module")
def model():
    from tests.conftest import make_tiny_llama
    return make_tiny_llama().train()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _step(model, ids, policy, tile, mask=None):
    handle = apply_activation_policy(model, policy, seq_tile=tile, min_bytes=0)
    try:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, attention_mask=mask).loss
        loss.backward()
    finally:
        handle.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def untiled(model, ids):
    return _step(model, ids, "recompute", 0)


@pytest.fixture
def calls(monkeypatch):
    n = []
    apply = tiled_block.TiledBlock.apply
    monkeypatch.setattr(tiled_block.TiledBlock, "apply", lambda *a: n.append(1) or apply(*a))
    return n


def _close(got, ref):
    return all((got[n] - g).abs().max() <= 2e-6 * g.abs().max() for n, g in ref.items())


def test_tiled_equals_untiled_but_for_rounding(model, ids, untiled, calls):
    got = _step(model, ids, "recompute", TILE)
    assert len(calls) == model.config.num_hidden_layers  # every block went through the tiles
    assert (got[0] - untiled[0]).abs() <= 1e-6 * untiled[0].abs()
    assert _close(got[1], untiled[1])
    assert not all(torch.equal(got[1][n], g) for n, g in untiled[1].items())  # (the sums did cross tiles)


def test_offloaded_tiled_equals_tiled_in_memory(model, ids, calls):
    ref = _step(model, ids, "recompute", TILE)
    for policy in ("recompute_nvme", "recompute_host"):
        got = _step(model, ids, policy, TILE)
        assert torch.equal(got[0], ref[0]) and all(torch.equal(got[1][n], g) for n, g in ref[1].items()), policy
    assert len(calls) == 3 * model.config.num_hidden_layers


def test_a_padding_mask_checkpoints_the_block_whole(model, ids, calls):
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a masked tensor reaches the blocks: not pure causal
    ref = _step(model, ids, "recompute", 0, mask)
    got = _step(model, ids, "recompute", TILE, mask)
    assert not calls
    # the MLP alone is tiled: its weights' gradients are summed per tile (tiling.py)
    assert torch.equal(got[0], ref[0]) and _close(got[1], ref[1])


def test_one_tile_of_the_recompute_saves_a_tile(model, ids, monkeypatch):
    """What autograd saves while one tile is recomputed: that tile's block activations and the
    sequence's key / value buffers (the prefix is a view of them), not the sequence's activations."""
    per_tile, enter = [], tiled_block._Tile.__enter__

    def entered(self):
        if self.mode == "grad":
            per_tile.append({})
        return enter(self)
    monkeypatch.setattr(tiled_block._Tile, "__enter__", entered)

    def pack(t):
        if per_tile and torch.is_grad_enabled():
            per_tile[-1].setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t
    handle = apply_activation_policy(model, "recompute", seq_tile=TILE)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss.backward()
    finally:
        handle.remove()
    saved = max(sum(v for k, v in tile.items() if k not in params) for tile in per_tile)
    b, cfg = ids.shape[0], model.config
    kv = b * SEQ * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    whole_block = b * block_activation_bytes(model_spec(model), "float32", SEQ, tiled=True)
    one_tile = b * block_activation_bytes(model_spec(model), "float32", TILE, tiled=True)
    assert len(per_tile) == 3 * cfg.num_hidden_layers
    assert saved <= one_tile + kv < whole_block / 2


def test_without_grouped_attention(tiny_llama_factory, ids, calls):
    model = tiny_llama_factory(kv_heads=4).train()  # one key / value head per query head
    ref = _step(model, ids, "recompute", 0)
    got = _step(model, ids, "recompute", TILE)
    assert len(calls) == model.config.num_hidden_layers
    assert (got[0] - ref[0]).abs() <= 1e-6 * ref[0].abs() and _close(got[1], ref[1])


def test_the_accelerator_path_lower_right_causal(model, ids, untiled, monkeypatch, calls):
    """The branch accelerators take (the prefix concatenated, lower-right causal SDPA), run here
    through the CPU's SDPA: the same attention, so the same result within rounding."""
    monkeypatch.setattr(tiled_block, "MERGED_ON", ())
    got = _step(model, ids, "recompute", TILE)
    assert calls and (got[0] - untiled[0]).abs() <= 1e-6 * untiled[0].abs() and _close(got[1], untiled[1])


def test_bfloat16(tiny_llama_factory, ids, calls):
    model = tiny_llama_factory().to(torch.bfloat16).train()
    ref = _step(model, ids, "recompute", 0)
    got = _step(model, ids, "recompute", TILE)
    assert len(calls) == model.config.num_hidden_layers
    assert all(g.dtype == torch.bfloat16 for g in got[1].values())
    # 16-bit rounding of the merge and of the per-tile sums (added in fp32): within a few bf16 ulps
    assert (got[0] - ref[0]).abs() <= 1e-2 * ref[0].abs()
    assert all((got[1][n] - g).abs().max() <= 0.05 * g.abs().max() for n, g in ref[1].items())


def test_the_input_gradient_reuses_a_private_output_gradient_only(model, ids, untiled, monkeypatch):
    """The input's gradient is written into the output's where only autograd holds it (every
    block of the model, measured by a spy); where an add hands the same gradient to another
    input still waiting (``z`` below), it gets its own buffer and ``z``'s gradient is intact."""
    seen, private = [], tiled_block._private
    monkeypatch.setattr(tiled_block, "_private", lambda g, x: seen.append(private(g, x)) or seen[-1])
    _step(model, ids, "recompute", TILE)
    assert seen == [True] * model.config.num_hidden_layers
    seen.clear()

    def run(tile):
        z0 = torch.zeros(*ids.shape, model.config.hidden_size, requires_grad=True)
        z = z0 * 1  # (not a leaf: its node runs after the block's)
        hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: out + z)
        try:
            _step(model, ids, "recompute", tile)
        finally:
            hook.remove()
        return z0.grad
    gz, ref_gz = run(TILE), run(0)
    assert seen[0] is False and all(seen[1:])  # the last block's gradient is shared with z
    assert (gz - ref_gz).abs().max() <= 2e-6 * ref_gz.abs().max()
