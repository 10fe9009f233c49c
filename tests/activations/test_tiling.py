"""Sequence-tiled MLP (activations/tiling.py) against the untiled block on a tiny Llama (fp32).

The forward, the loss and every gradient but the MLP's own weights are bit-identical; the
MLP weights' gradients are sums over tokens added up per tile, so they differ by fp32
rounding only (the bound of activations/tiling.py). With tiling on, every activation
policy gives the same bits as keeping the activations.
"""
from __future__ import annotations

import pytest
import torch
from outcore.activations import apply_activation_policy
from outcore.activations.policy import parse_seq_tile
from outcore.activations.tiling import auto_tile, tile_mlp, tile_of
from outcore.errors import ConfigError

TILE = 64  # tokens per tile: the micro-batch below has 2 x 200 = 400 rows, ~6 tiles
MLP_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture
def model(tiny_llama):
    return tiny_llama.train()


def _ids(seq=200):
    return torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(1))


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _tiled(model, tile=TILE):
    removers = [tile_mlp(layer.mlp, tile) for layer in model.model.layers]
    return lambda: [r() for r in removers]


def _is_mlp_weight(name):
    return ".mlp." in name and name.split(".")[-2] in MLP_WEIGHTS


def test_tiled_equals_untiled_forward_and_backward(model):
    ids = _ids()
    ref = _step(model, ids)
    untile = _tiled(model)
    got = _step(model, ids)
    untile()
    assert torch.equal(got[0], ref[0])  # the forward: every row computed as untiled
    for name, g in ref[1].items():
        if not _is_mlp_weight(name):
            assert torch.equal(got[1][name], g), name  # every gradient below and beside the MLP
        else:  # a sum over 400 tokens in another order: fp32 rounding, ~4e-7 of the largest element
            assert (got[1][name] - g).abs().max() <= 1e-5 * g.abs().max(), name
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)  # unwrapped


def test_one_adamw_step_moves_only_the_mlp_weights_by_rounding(model):
    ids, lr = _ids(), 1e-3
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def stepped(tiled):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        untile = _tiled(model) if tiled else (lambda: None)
        _step(model, ids)
        untile()
        opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    ref, got = stepped(False), stepped(True)
    for name, w in ref.items():
        if not _is_mlp_weight(name):
            assert torch.equal(got[name], w), name
        else:
            # Adam's first step is lr * g / (|g| + eps): a rounding-level change of g moves it
            # by at most 2 lr, and only where |g| is itself at rounding level
            diff = (got[name] - w).abs()
            assert diff.max() <= 2 * lr, name
            assert (diff > 1e-3 * lr).float().mean() < 0.01, name


@pytest.mark.parametrize("policy", ["offload_nvme", "offload_host", "offload"])
def test_every_policy_with_tiling_equals_keep_with_tiling(model, policy):
    """(A recomputed block is tiled whole: tests/activations/test_tiled_block.py.)"""
    ids = _ids()
    keep = apply_activation_policy(model, "keep", seq_tile=TILE)
    assert keep.tile == TILE
    ref = _step(model, ids)
    keep.remove()
    handle = apply_activation_policy(model, policy, min_bytes=0, seq_tile=TILE)
    try:
        got, again = _step(model, ids), _step(model, ids)
    finally:
        handle.remove()
    for a in (got, again):
        assert torch.equal(a[0], ref[0]) and all(torch.equal(a[1][n], g) for n, g in ref[1].items())


def test_mlp_saves_only_its_input_when_tiled(model):
    """The bytes autograd keeps for the MLP drop from four [tokens, intermediate] tensors to
    none of its own (its input is the norm's output, saved already)."""
    ids = _ids()

    def saved_bytes():
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(v for k, v in seen.items() if k not in params)

    untiled = saved_bytes()
    untile = _tiled(model)
    tiled = saved_bytes()
    untile()
    cfg = model.config
    mlp = ids.numel() * cfg.num_hidden_layers * 4 * cfg.intermediate_size * 4  # gate, act, up, product
    assert untiled - tiled == mlp


def test_no_grad_and_short_inputs_run_untiled_results(model):
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        untile = _tiled(model)
        tiled = model(input_ids=ids).logits
        short = model(input_ids=ids[:, :16]).logits  # 32 rows: one tile, the untiled forward
        untile()
        assert torch.equal(tiled, ref) and torch.equal(short, model(input_ids=ids[:, :16]).logits)


def test_seq_tile_values(model):
    assert parse_seq_tile("auto") == "auto" and parse_seq_tile("4096") == 4096 and parse_seq_tile(0) == 0
    for bad in (-1, "big", 1.5, True):
        with pytest.raises(ConfigError, match="seq_tile"):
            parse_seq_tile(bad)
    assert auto_tile(1536, 4) == 4096  # SmolLM2 in fp32: one [tile, 1536] tensor is 24 MiB
    assert auto_tile(14336, 2) == 1024  # Llama-3-8B in bf16
    assert tile_of(model, "auto") == auto_tile(model.config.intermediate_size, 4) and tile_of(model, 0) == 0
    with pytest.raises(ConfigError, match="seq_tile"):
        apply_activation_policy(model, "keep", seq_tile="x")


@pytest.mark.slow(ci=True)
def test_tiled_out_of_core_run_equals_tiled_in_memory(tiny_run_inputs, tmp_path, monkeypatch):
    """The recipe tiles from ``seq_tile``; weights streamed from NVMe and blocks recomputed
    (their checkpoints kept, or on NVMe) give the in-memory tiled run's losses bit for bit."""
    import outcore.activations
    from outcore.recipes.full_finetune import finetune
    from outcore.training.config import load_config
    from tests._helpers import RecordingSink

    tiles, blocks = [], []
    real = outcore.activations.apply_activation_policy

    def noting(*a, **kw):
        handle = real(*a, **{**kw, "min_bytes": 0})  # the tiny model's checkpoints are below the default
        tiles.append(handle.tile)
        remove = handle.remove

        def remove_and_note():
            blocks.append(handle.offloader.stats["blocks"] if handle.offloader is not None else 0)
            remove()
        handle.remove = remove_and_note
        return handle
    monkeypatch.setattr(outcore.activations, "apply_activation_policy", noting)

    def run(name, **kw):
        base = dict(model=str(tiny_run_inputs / "model"), data=str(tiny_run_inputs / "data.txt"), seq_len=32,
                    batch_size=2, max_steps=3, eval_every=0, eval_batches=1, lr=1e-3, warmup_steps=1,
                    output=str(tmp_path / name), ui="none", val_fraction=0.1, seq_tile=16)
        return finetune(load_config(overrides={**base, **kw}), sink=RecordingSink())

    mem = run("mem", offload="none")
    ooc = run("ooc", offload="nvme", activations="recompute")
    # block checkpoints on the run's NVMe (the engine's store), read back for each recompute
    ckpt = run("ckpt", offload="nvme", activations="recompute_nvme", activations_keep_last=0)
    assert tiles == [16, 16, 16]  # 64 rows per micro-batch: 4 tiles in every run
    assert blocks[:2] == [0, 0] and blocks[2] > 0  # checkpoints really went through the store
    assert mem.losses == ooc.losses == ckpt.losses


def test_bfloat16_sums_the_tiles_in_fp32(model):
    """16-bit weights: each tile's weight gradient (rounded to bf16 by its own GEMM) is added up
    in fp32 and rounded once; what is per token stays bit-identical."""
    model.to(torch.bfloat16)
    ids = _ids()
    ref = _step(model, ids)
    untile = _tiled(model)
    got = _step(model, ids)
    untile()
    assert torch.equal(got[0], ref[0])
    tiles = -(-ids.numel() // TILE)
    for name, g in ref[1].items():
        if not _is_mlp_weight(name):
            assert torch.equal(got[1][name], g), name
        else:  # at most one bf16 rounding (2**-8 relative) of a partial sum per tile
            assert got[1][name].dtype == torch.bfloat16
            assert (got[1][name].float() - g.float()).abs().max() <= tiles * 2 ** -8 * g.float().abs().max(), name
