"""Long context in the plan: the tiled MLP and the chunked head sized as they run, block
checkpoints on NVMe counted there, the longest context that fits and the refusal that names it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from outcore.activations.tiling import tile_mlp
from outcore.errors import BudgetError
from outcore.planner import Budgets, make_plan
from outcore.planner.longest import ROUND
from outcore.planner.sizes import (block_activation_bytes, checkpoint_bytes, chunked_head_bytes, model_spec,
                                  tiled_block_bytes)

GiB = 1 << 30
BIG = Budgets(device_bytes=64 * GiB, host_bytes=64 * GiB, nvme_bytes=1 << 40, ram_bytes=64 * GiB,
              disk_read_gbps=2.0, disk_write_gbps=3.0, h2d_gbps=8.0, d2h_gbps=8.0, host_mem_gbps=8.0,
              flops=1e11, measured=True)
TIGHT = dataclasses.replace(BIG, device_bytes=256 << 20, host_bytes=256 << 20, ram_bytes=512 << 20)


@pytest.fixture
def tiny(tiny_llama_factory):
    return tiny_llama_factory(layers=4, hidden=64, vocab=256, heads=4, kv_heads=2, intermediate=128)


def test_tiled_block_estimate_matches_what_autograd_saves(tiny):
    b, s = 2, 48
    pe = tiny.model.rotary_emb(torch.empty(1, s, 64), torch.arange(s)[None])
    # Not a block's activations: the weights, and the rotary tables every block and sequence shares.
    shared = {t.untyped_storage().data_ptr() for t in (*tiny.parameters(), *pe)}
    untile = [tile_mlp(layer.mlp, 16) for layer in tiny.model.layers]
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t
    tiny.train()
    outs = []  # each block's graph stays alive, so no saved tensor's storage is freed and its address reused
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in tiny.model.layers:  # the blocks alone: hidden states in, hidden states out
            x = torch.randn(b, s, 64, requires_grad=True)
            outs.append(layer(x, position_embeddings=pe))
    [u() for u in untile]
    saved = sum(v for k, v in seen.items() if k not in shared)
    expected = b * 4 * block_activation_bytes(model_spec(tiny), "float32", s, tiled=True)
    assert saved <= expected <= 1.1 * saved, (saved, expected)  # never under; over by < 10%


def test_checkpoints_on_nvme_are_counted_there(tiny):
    s, b = 512, 2
    nvme = make_plan(tiny, offload="none", activations="recompute_nvme", budgets=BIG, seq_len=s, batch_size=b)
    dev = make_plan(tiny, offload="none", activations="recompute", budgets=BIG, seq_len=s, batch_size=b)
    ckpt = b * checkpoint_bytes(model_spec(tiny), "float32", s)
    near = 2  # offload "none": no unit window, one checkpoint read ahead and the last block's
    assert nvme.tier_bytes["NVME"]["activations"] == (4 - near) * ckpt
    # the blocks' backward holds one more on NVMe: the checkpoint of the block in flight, read back
    assert dev.tier_bytes["DEVICE"]["activations"] - nvme.tier_bytes["DEVICE"]["activations"] == (3 - near) * ckpt
    assert nvme.written_per_step_bytes == (4 - near) * ckpt and dev.written_per_step_bytes == 0
    assert nvme.time.io_bytes["nvme_read"] == (4 - near) * ckpt


def test_tiling_lowers_what_a_step_holds(tiny):
    s = 4096
    untiled = make_plan(tiny, offload="none", activations="keep", budgets=BIG, seq_len=s, seq_tile=0)
    tiled = make_plan(tiny, offload="none", activations="keep", budgets=BIG, seq_len=s, seq_tile=512)
    assert tiled.seq_tile == 512 and untiled.seq_tile == 0
    saved = untiled.tier_bytes["DEVICE"]["activations"] - tiled.tier_bytes["DEVICE"]["activations"]
    # 4 blocks' MLP tensors; a tile's backward is a phase apart from the loss's, which holds more here
    loss, tile = chunked_head_bytes(model_spec(tiny), "float32", s)[1], 8 * 512 * 128 * 4
    assert loss > tile and saved == 4 * s * 4 * 128 * 4
    assert tiled.time.compute_s > untiled.time.compute_s  # each tile recomputed in the backward


def test_a_recomputed_block_is_planned_tiled_whole(tiny):
    s, b, tile = 4096, 2, 512
    spec = model_spec(tiny)
    assert spec.tileable_block
    plan = make_plan(tiny, offload="none", activations="recompute", budgets=BIG, seq_len=s, batch_size=b,
                     seq_tile=tile)
    assert plan.blocks_tiled and "recomputed blocks tiled: 512 positions per tile" in plan.table()
    kept, loss = chunked_head_bytes(spec, "float32", b * s)
    recompute = tiled_block_bytes(spec, "float32", s, tile, b)
    grad = b * s * 64 * 4  # d loss / d the last hidden state, held through the blocks' backward
    # RoPE's tables, as the model makes them for the step (one row of positions), held all step
    rope = sum(t.nbytes for t in tiny.model.rotary_emb(torch.empty(1, s, 64), torch.arange(s)[None]))
    assert plan.tier_bytes["DEVICE"]["activations"] == 4 * b * checkpoint_bytes(spec, "float32", s) + rope + max(
        kept + loss, grad + recompute)
    # one tile's graph and the keys / values: less than the whole block's saved tensors and MLP tile
    assert recompute < b * block_activation_bytes(spec, "float32", s, tiled=True) + 8 * tile * 128 * 4
    keep = make_plan(tiny, offload="none", activations="keep", budgets=BIG, seq_len=s, batch_size=b, seq_tile=tile)
    assert not keep.blocks_tiled  # (only a recomputed block is a checkpoint to tile)


def test_eager_attention_is_not_tiled_whole(tiny_llama_factory):
    eager = tiny_llama_factory()
    eager.config._attn_implementation = "eager"
    assert not model_spec(eager).tileable_block
    plan = make_plan(eager, offload="none", activations="recompute", budgets=BIG, seq_len=4096, seq_tile=512)
    assert not plan.blocks_tiled and plan.seq_tile == 512  # the MLP alone


def test_packed_documents_count_their_mask_and_tile_no_block(tiny):
    """With packed documents attention takes a boolean [b, 1, s, s] mask and every block saves
    SDPA's float copy of it (tests/planner/test_plan.py measures what a block saves)."""
    s, b = 1024, 2
    plans = {pf: {a: make_plan(tiny, offload="none", activations=a, budgets=BIG, seq_len=s, batch_size=b,
                               seq_tile=512, padding_free=pf) for a in ("keep", "recompute")}
             for pf in (False, True)}
    assert plans[False]["recompute"].blocks_tiled and not plans[True]["recompute"].blocks_tiled
    keep = [plans[pf]["keep"].tier_bytes["DEVICE"]["activations"] for pf in (False, True)]
    # and RoPE's tables per sequence, not one row for all: the documents' position ids differ by row
    rope = sum(t.nbytes for t in tiny.model.rotary_emb(torch.empty(b, s, 64), torch.arange(s).repeat(b, 1)))
    assert keep[1] - keep[0] == 4 * b * s * s * 4 + b * s * s + (b - 1) * rope // b


def test_a_block_saves_the_packed_documents_mask_in_the_compute_dtype(tiny):
    s, b = 48, 2
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
    mask[:, :, 20:, :20] = False  # two documents
    pe = tiny.model.rotary_emb(torch.empty(1, s, 64), torch.arange(s)[None])
    seen = []

    def pack(t):
        seen.append((t.dtype, tuple(t.shape)))
        return t
    tiny.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiny.model.layers[0](torch.randn(b, s, 64, requires_grad=True), attention_mask=mask, position_embeddings=pe)
    assert (torch.float32, (b, 1, s, s)) in seen  # the plan's b x s x s x c per block


def test_longest_context_fits_and_a_longer_one_does_not(tiny):
    plan = make_plan(tiny, offload="none", activations="auto", budgets=TIGHT, seq_len=256, batch_size=1)
    longest = plan.longest
    assert longest is not None and longest.seq_len > 256 and longest.seq_len % ROUND == 0
    at = make_plan(tiny, offload="none", activations=longest.activations, budgets=TIGHT,
                   seq_len=longest.seq_len, batch_size=1)
    assert at.activations == longest.activations
    with pytest.raises(BudgetError):
        make_plan(tiny, offload="none", activations=longest.activations, budgets=TIGHT,
                  seq_len=longest.seq_len + ROUND, batch_size=1)
    # no policy fits a longer one (the search weighs them all)
    for policy in ("keep", "recompute", "offload", "recompute_host", "recompute_nvme"):
        with pytest.raises(BudgetError):
            make_plan(tiny, offload="none", activations=policy, budgets=TIGHT, seq_len=longest.seq_len + ROUND,
                      batch_size=1)
    assert plan.to_dict()["longest_context"]["seq_len"] == longest.seq_len
    assert f"longest context that fits: {longest.seq_len} tokens" in plan.table()


def test_a_length_that_does_not_fit_is_refused_naming_the_longest(tiny):
    plan = make_plan(tiny, offload="none", activations="auto", budgets=TIGHT, seq_len=256, batch_size=1)
    n = plan.longest.seq_len
    with pytest.raises(BudgetError) as e:
        make_plan(tiny, offload="none", activations="keep", budgets=TIGHT, seq_len=8 * n, batch_size=2)
    msg = str(e.value)
    assert "\n" not in msg and f"seq_len={8 * n} does not fit" in msg
    assert f"the longest context that fits is {n} tokens: --seq-len {n} --activations " \
           f"{plan.longest.activations} --batch-size 1" in msg
    # a length another policy trains is refused naming that policy
    with pytest.raises(BudgetError, match=f"it fits with --activations {plan.longest.activations}"):
        make_plan(tiny, offload="none", activations="keep", budgets=TIGHT, seq_len=n, batch_size=1)


def test_beyond_the_trained_length_the_plan_says_how_positions_go():
    from transformers import LlamaConfig

    def plan(**rope):
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=True, **rope)
        return make_plan(cfg, offload="none", activations="auto", budgets=TIGHT, seq_len=256, batch_size=1)
    plain = plan().longest
    assert plain.seq_len > 512 and plain.rope_scaling == ""
    assert "beyond the 512 tokens the model was trained at: positions extrapolated" in plain.describe()
    yarn = plan(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                 "original_max_position_embeddings": 512}).longest
    assert yarn.rope_scaling == "yarn x4.0" and "RoPE scaling yarn x4.0" in yarn.describe()
