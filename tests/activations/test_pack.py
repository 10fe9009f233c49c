"""BlockPack: saved tensors grouped by storage, laid out in one buffer, rebuilt with the same strides."""
from __future__ import annotations

import pytest
import torch
from outcore.activations.pack import ALIGN, BlockPack, storage_span


def _roundtrip(pack: BlockPack, refs):
    buf = torch.full((pack.seal() + 128,), 0xAB, dtype=torch.uint8)  # garbage around the data
    pack.copy_into(buf)
    return [BlockPack.view(buf, r) for r in refs]


def test_aliases_are_stored_once_and_restored_exactly():
    x = torch.randn(2, 16, 24)
    flat = x.view(32, 24)  # a Linear saves this view once per projection (q, k, v)
    y = torch.randn(3, 5, 7).transpose(0, 2)  # non-contiguous: strides must survive
    z = torch.arange(10, dtype=torch.int64)[3:9]  # offset into its storage
    pack = BlockPack()
    refs = [pack.add(t) for t in (x, flat, flat, flat, y, z)]
    assert all(r is not None for r in refs)
    n = pack.seal()
    assert n == sum(-(-b // ALIGN) * ALIGN for b in (x.nbytes, y.nbytes, 8 * 6 + 3 * 8 % ALIGN))
    assert pack.saved_bytes == 4 * x.nbytes + y.nbytes + z.nbytes
    out = _roundtrip(pack, refs)
    for src, got in zip((x, flat, flat, flat, y, z), out):
        assert got.dtype == src.dtype and got.shape == src.shape and got.stride() == src.stride()
        assert torch.equal(got, src)
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()


def test_sparse_in_storage_tensors_are_not_packed_broadcast_ones_are_small():
    pack = BlockPack()
    big = torch.randn(100, 100)
    assert pack.add(big[:, :3]) is None  # reads 3 of every 100 floats: copying the span is waste
    assert pack.add(torch.empty(0)) is None
    wide = torch.randn(4, 1).expand(4, 1000)  # stride 0: only its 16 bytes move
    flipped = torch.randn(5).flip(0)
    refs = [pack.add(wide), pack.add(flipped)]
    assert pack.seal() == 2 * ALIGN
    got = _roundtrip(pack, refs)
    assert got[0].stride() == (1, 0) and torch.equal(got[0], wide) and torch.equal(got[1], flipped)
    assert storage_span(torch.randn(4, 3).t()) == (0, 48)


def test_modified_in_place_after_save_is_an_error():
    t = torch.randn(8, 8)
    pack = BlockPack()
    pack.add(t)
    t.add_(1)
    pack.seal()
    with pytest.raises(RuntimeError, match=r"shape \(8, 8\) saved for backward was modified in place"):
        pack.copy_into(torch.empty(pack.nbytes, dtype=torch.uint8))


def test_order_of_life_cycle_is_enforced():
    pack = BlockPack()
    pack.add(torch.randn(3))
    with pytest.raises(RuntimeError, match="before seal"):
        pack.copy_into(torch.empty(64, dtype=torch.uint8))
    pack.seal()
    with pytest.raises(RuntimeError, match="after seal"):
        pack.add(torch.randn(3))


def test_other_device_or_dtype_mix_in_one_storage():
    x = torch.randn(64)
    as_int = x.view(torch.int32)[8:40]  # the same bytes seen as another dtype, at an offset
    pack = BlockPack()
    refs = [pack.add(x), pack.add(as_int)]
    assert pack.seal() == x.nbytes
    a, b = _roundtrip(pack, refs)
    assert torch.equal(a, x) and torch.equal(b, as_int)
