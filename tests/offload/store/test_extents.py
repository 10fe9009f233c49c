"""TieredStore's anonymous NVMe extents: round trip, traffic, budget errors, freed space."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from outcore.errors import BudgetError, IntegrityError
from outcore.offload.aligned import aligned_empty
from outcore.offload.store import Tier, TieredStore

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    s = TieredStore(device_bytes=0, host_bytes=0, nvme_bytes=4 * MiB, swap_dir=tmp_path / "swap", device="cpu")
    yield s
    s.close()


def _random_buffer(nbytes: int, seed: int = 0) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), generator=torch.Generator().manual_seed(seed),
                            dtype=torch.uint8))
    return buf


def test_extent_round_trip_counts_its_bytes(store):
    ext = store.alloc_extent("a", 10_000)
    assert ext.length == 12_288 and store.held(Tier.NVME) == ext.length  # 4 KiB-padded
    src = _random_buffer(ext.length)
    assert store.write_extent(ext, src).result() is ext
    stats = store.tier_stats()
    assert (stats["NVME"].written_bytes, stats["HOST"].read_bytes) == (ext.length, ext.length)
    assert stats["NVME"].read_bytes == 0 and stats["HOST"].held_bytes == 0  # the caller's buffer
    dst = aligned_empty(ext.length)
    assert store.read_extent(ext, dst).result() is dst
    assert torch.equal(dst, src)
    stats = store.tier_stats()
    assert (stats["NVME"].read_bytes, stats["HOST"].written_bytes) == (ext.length, ext.length)
    assert store.nvme.written_bytes == ext.length == store.nvme.read_bytes  # the disk saw the same


def test_freed_extent_gives_its_space_back(store):
    first = store.alloc_extent("a", 3 * MiB)
    with pytest.raises(BudgetError):
        store.alloc_extent("b", 2 * MiB)
    store.free_extent(first)
    assert store.held(Tier.NVME) == 0
    second = store.alloc_extent("b", 4 * MiB)  # the whole budget again
    assert store.held(Tier.NVME) == 4 * MiB == second.length


def test_budget_error_names_the_budget_what_is_held_and_what_to_do(store, tmp_path):
    store.alloc_extent("a", 3 * MiB)
    with pytest.raises(BudgetError) as err:
        store.alloc_extent("b", 2 * MiB, what="the activations of block 7", advice="keep more blocks")
    assert str(err.value) == ("NVME tier budget 4.0 MiB cannot hold the activations of block 7 "
                              "(2.0 MiB requested, 3.0 MiB held); keep more blocks")
    with pytest.raises(BudgetError, match=r"cannot hold 'b' .*; raise the nvme budget"):
        store.alloc_extent("b", 2 * MiB)  # the store's own wording by default
    with TieredStore(device_bytes=0, host_bytes=MiB, device="cpu") as no_disk:
        assert not no_disk.has_tier("nvme") and no_disk.has_tier(Tier.HOST) and not no_disk.has_tier("device")
        with pytest.raises(BudgetError, match=r"^NVME tier budget none \(no swap_dir\) cannot hold x "):
            no_disk.alloc_extent("x", 4096, what="x")
    assert store.has_tier("nvme")


def test_failed_read_is_not_counted_and_unwritten_extent_refused(store):
    ext = store.alloc_extent("a", 4096)
    with pytest.raises(IntegrityError, match="never written"):
        store.read_extent(ext, aligned_empty(4096))
    store.write_extent(ext, _random_buffer(4096)).result()
    with open(store.nvme.path, "r+b") as f:  # a flipped byte on disk
        f.seek(ext.offset + 100)
        byte = f.read(1)
        f.seek(ext.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        store.read_extent(ext, aligned_empty(4096)).result()
    assert store.tier_stats()["NVME"].read_bytes == 0


def test_synchronize_waits_for_extent_transfers(store, monkeypatch):
    ext = store.alloc_extent("a", 4096)
    pending = Future()
    pending.set_running_or_notify_cancel()
    monkeypatch.setattr(store.nvme, "write", lambda ext, src: pending)
    f = store.write_extent(ext, aligned_empty(4096))
    timer = threading.Timer(0.2, pending.set_result, args=(0,))
    timer.start()
    store.synchronize()
    assert f.done() and f.result() is ext and store.tier_stats()["NVME"].written_bytes == 4096
    timer.join()
