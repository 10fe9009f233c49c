"""Compressed activation offload (``activations_compress`` int8 / fp8): the codecs' error
bounds, the stored bytes, gradients close to exact ones, and the config / plan hooks."""
from __future__ import annotations

import time

import pytest
import torch
from outcore.activations import apply_activation_policy
from outcore.activations.compress import CHUNK, Codec, codec_for
from outcore.activations.pack import BlockPack
from outcore.activations.policy import COMPRESS_BLOCK, BlockProfile, choose_policy, compressed_ratio
from outcore.errors import ConfigError


def _blockwise_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each element's block absmax (blocks of COMPRESS_BLOCK consecutive elements)."""
    flat = x.float().reshape(-1)
    pad = -flat.numel() % COMPRESS_BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, COMPRESS_BLOCK)
    return blocks.abs().amax(1).repeat_interleave(COMPRESS_BLOCK)[:flat.numel()]


def _roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    out = torch.full((codec.stored_bytes(x.numel()),), 0xAB, dtype=torch.uint8)
    codec.encode(x.reshape(-1), out)
    got = torch.empty(x.numel(), dtype=x.dtype)
    codec.decode(out, got)
    return got


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 4096 + 7, CHUNK + 300])  # the last: two chunks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_error_is_at_most_half_a_step_of_the_block_grid(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 2, n)).to(dtype)  # blocks of very different scales
    x[: min(n, 300)] = 0  # an all-zero block stays zero
    got = _roundtrip(Codec("int8"), x)
    assert got.dtype == dtype and got.shape == (n,)
    err = (got.float() - x.float()).abs()
    step = _blockwise_absmax(x) / 127
    cast = got.float().abs() * (2 ** -8 if dtype == torch.bfloat16 else 0)  # rounding back into bf16
    bound = step / 2 * (1 + 1e-6) + cast
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(got[: min(n, 300)].float(), torch.zeros(min(n, 300)))
    if n >= 1000:  # the bound is not vacuous: the worst error is near half a step
        assert float((err / step.clamp_min(1e-30)).max()) > 0.4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_error_is_relative_with_a_floor_below_the_normal_range(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3000, generator=g) * torch.logspace(-4, 1, 3000)).to(dtype)
    got = _roundtrip(Codec("fp8"), x)
    err = (got.float() - x.float()).abs()
    scale = _blockwise_absmax(x) / 448
    cast = got.float().abs() * (2 ** -8 if dtype == torch.bfloat16 else 0)
    bound = (x.float().abs() / 16 + scale * 2 ** -10) * (1 + 1e-6) + cast  # 3 mantissa bits; subnormal step 2^-9
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float((err / x.float().abs().clamp_min(1e-30)).max()) > 0.02  # really 8-bit, not a copy


def test_stored_bytes_are_codes_plus_one_scale_per_block():
    c = Codec("int8")
    assert c.stored_bytes(512) == 512 + 64  # two fp32 scales, padded to 64 bytes
    assert c.stored_bytes(10 * COMPRESS_BLOCK + 1) == 2624 + 64  # 2561 codes -> 2624; 11 scales = 44 -> 64
    with pytest.raises(ConfigError, match="int4"):
        codec_for("int4")
    assert codec_for("none") is None
    assert compressed_ratio("int8", 2) == pytest.approx(260 / 512)
    assert compressed_ratio("fp8", 4) == pytest.approx(260 / 1024) and compressed_ratio("none", 2) == 1.0


def test_pack_encodes_covered_float_groups_and_keeps_the_rest_exact():
    x = torch.randn(4, 1024, requires_grad=True) * 1  # a block activation (non-leaf, requires grad)
    flat = x.view(-1)  # an alias: same group
    rsqrt = torch.rand(4, 1, requires_grad=True) * 1  # a per-row statistic: stays exact
    ids = torch.arange(2048)  # not floating point: stays exact
    lse = torch.randn(4, 300)  # no autograd through it (log-sum-exp-like): stays exact
    gap = (torch.randn(2048, requires_grad=True) * 1)[::2]  # reads half its span: stays exact
    pack = BlockPack(codec=Codec("int8"))
    refs = [pack.add(t) for t in (x, flat, rsqrt, ids, lse, gap)]
    stored = pack.seal()
    assert stored < pack.raw_nbytes
    buf = torch.full((stored + 64,), 0xAB, dtype=torch.uint8)
    pack.copy_into(buf)
    raw = pack.restore(buf)
    assert raw.numel() == pack.raw_nbytes
    got = [BlockPack.view(raw, r) for r in refs]
    assert all(g.shape == t.shape and g.stride() == t.stride() for g, t in zip(got, (x, flat, rsqrt, ids, lse, gap)))
    assert not torch.equal(got[0], x.detach()) and torch.allclose(got[0], x.detach(),
                                                                  atol=float(x.detach().abs().max()) / 200)
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
    for g, t in zip(got[2:], (rsqrt, ids, lse, gap)):
        assert torch.equal(g, t.detach())
    plain = BlockPack()
    plain.add(x)
    plain.seal()
    assert plain.raw_nbytes == plain.nbytes and plain.restore(buf) is buf  # no codec: no decode, no copy


def _ids(seq=96):
    return torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(1))


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("codec,tol", [("int8", 0.02), ("fp8", 0.05)])
def test_compressed_offload_gradients_are_close_to_exact(tiny_llama_factory, codec, tol, compute_device):
    """Relative L2 error of all gradients (fp32 tiny Llama): measured 0.004 (int8) and 0.015
    (fp8); the forward is untouched, so the loss is bit-identical (to KEEP on the same device)."""
    model = tiny_llama_factory(hidden=128, intermediate=384).train().to(compute_device)
    ids = _ids().to(compute_device)
    loss0, g0 = _grads(model, ids)
    handle = apply_activation_policy(model, "offload", min_bytes=0, compress=codec)
    try:
        loss1, g1 = _grads(model, ids)
        stats = dict(handle.offloader.stats)
    finally:
        handle.remove()
    assert torch.equal(loss0, loss1)
    rel = float((g1 - g0).norm() / g0.norm())
    assert 0 < rel < tol, rel
    assert stats["offloaded_bytes"] < 0.4 * stats["raw_bytes"]  # fp32: ~0.3


def _offloaded_bytes(model, ids, tmp_path, compress: str) -> tuple[int, int]:
    """(NVMe bytes the store wrote and read for one step's offloaded activations)."""
    from outcore.offload import TieredStore

    with TieredStore(device_bytes=0, host_bytes=0, swap_dir=tmp_path / f"swap-{compress}") as store:
        handle = apply_activation_policy(model, "offload_nvme", store=store, min_bytes=0, compress=compress)
        try:
            _grads(model, ids)
            nvme = store.tier_stats()["NVME"]
            return nvme.written_bytes, nvme.read_bytes
        finally:
            handle.remove()


def test_store_moves_the_compressed_bytes_bf16(tiny_llama_factory, tmp_path):
    model = tiny_llama_factory(hidden=256, intermediate=768).train().to(torch.bfloat16)
    ids = _ids(256)
    exact = _offloaded_bytes(model, ids, tmp_path, "none")
    for codec in ("int8", "fp8"):
        small = _offloaded_bytes(model, ids, tmp_path, codec)
        assert exact[0] > 0 and small[0] == small[1]  # every stored byte read back once
        assert small[0] <= 0.55 * exact[0], (codec, small, exact)


def test_host_tier_holds_the_compressed_bytes(tiny_llama_factory, tmp_path):
    from outcore.offload import Tier, TieredStore

    model = tiny_llama_factory(hidden=128, intermediate=384).train()
    held = {}
    for codec in ("none", "int8"):
        with TieredStore(device_bytes=0, host_bytes=16 << 20, swap_dir=tmp_path / codec) as store:
            handle = apply_activation_policy(model, "offload_host", store=store, min_bytes=0, compress=codec)
            try:
                loss = model(input_ids=_ids(), labels=_ids()).loss
                handle.offloader._copier.submit(lambda: None).result()
                for _ in range(200):  # the last block's copy lands on the writer thread
                    if handle.offloader._inflight == 0:
                        break
                    time.sleep(0.01)
                held[codec] = store.held(Tier.HOST)
                loss.backward()
                assert store.held(Tier.HOST) == 0
            finally:
                handle.remove()
    assert 0 < held["int8"] <= 0.4 * held["none"]


def test_choice_and_plan_size_offloads_by_the_compressed_bytes():
    # 4 blocks saving 100 bytes (30 compressed); the device holds the last one; HOST has room
    # for 150: three compressed blocks fit there, one exact block only (the others recompute
    # and keep 10 bytes each, over the device budget)
    from outcore.errors import BudgetError

    kw = dict(host_budget=150, host_bps=1e12, keep_last=1)
    got = choose_policy([BlockProfile(100, 10, 1.0, offload_bytes=30)] * 4, 100, **kw)
    assert [p.value for p in got] == ["offload_host"] * 3 + ["keep"]
    with pytest.raises(BudgetError, match="activations need 120 bytes"):
        choose_policy([BlockProfile(100, 10, 1.0)] * 4, 100, **kw)
    from transformers import LlamaConfig

    from outcore.planner import Budgets, make_plan

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    budgets = Budgets(device_bytes=1 << 30, host_bytes=1 << 30, nvme_bytes=1 << 34, ram_bytes=1 << 31,
                      flops=1e12)
    host = {c: make_plan(cfg, activations="offload", offload="none", budgets=budgets, dtype="bfloat16",
                         activations_compress=c).tier_bytes["HOST"]["activations"] for c in ("none", "int8")}
    assert host["int8"] == int(host["none"] * 260 / 512)


def test_config_and_apply_refuse_an_unknown_codec(tiny_llama):
    from outcore.training.config import load_config

    assert load_config(overrides={"activations_compress": "fp8"}).activations_compress == "fp8"
    with pytest.raises(ConfigError, match="activations_compress.*int4"):
        load_config(overrides={"activations_compress": "int4"})
    with pytest.raises(ConfigError, match="int4"):
        apply_activation_policy(tiny_llama, "offload", compress="int4")
