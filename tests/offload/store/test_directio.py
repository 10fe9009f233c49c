"""Direct I/O core, the free-list allocator, the arena, the device module, package exports."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from outcore.offload.aligned import ALIGN, aligned_empty

from outcore.offload.device import Device

from outcore.offload.store.probe import measure_copy_gbps
from outcore.offload.device import list_devices
from outcore.offload.store.arena import Arena, FreeList
from outcore.offload.store.directio import IOPool, is_aligned, open_direct, supports_o_direct
from outcore.offload.store.nvme import checksum


def test_aligned_empty_is_page_aligned_and_populated():
    for n in (1, 4095, 4096, 1 << 20 | 3):
        t = aligned_empty(n)
        assert t.data_ptr() % ALIGN == 0 and t.numel() % ALIGN == 0 and t.numel() >= n
        assert int(t.sum()) == 0 and is_aligned(t)
    with pytest.raises(ValueError, match="nbytes=0"):
        aligned_empty(0)


def test_pool_round_trip_o_direct_reaches_the_disk(tmp_path):
    """O_DIRECT I/O shows up in /proc/self/io (the block layer), not only the page cache."""
    def io():
        return {k: int(v) for k, v in (line.split(":") for line in open("/proc/self/io"))}
    assert supports_o_direct(tmp_path)
    fd, direct = open_direct(tmp_path / "f")
    assert direct
    pool = IOPool(queue_depth=3, chunk_bytes=64 << 10)
    src = aligned_empty(1 << 20)
    src.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    dst = aligned_empty(1 << 20)
    try:
        before = io()
        assert pool.write(fd, src, 8192).result() == 1 << 20
        mid = io()
        got = pool.read(fd, dst, 8192, on_done=lambda vals: [v[0] for v in vals]).result()
        after = io()
    finally:
        pool.close()
        os.close(fd)
    assert got == [64 << 10] * 16 and torch.equal(src, dst)
    assert mid["write_bytes"] - before["write_bytes"] >= 1 << 20
    assert after["read_bytes"] - mid["read_bytes"] >= 1 << 20


def test_pool_chunk_hook_sees_every_chunk(tmp_path):
    fd, _ = open_direct(tmp_path / "f")
    pool = IOPool(2, 8192)
    buf = aligned_empty(5 * 8192)
    try:
        seen = pool.write(fd, buf, 0, on_done=lambda v: [x[1] for x in v],
                          chunk_hook=lambda mv: len(mv)).result()
    finally:
        pool.close()
        os.close(fd)
    assert seen == [8192] * 5


def test_pool_rejects_bad_settings():
    with pytest.raises(ValueError, match="queue_depth=0"):
        IOPool(0)
    with pytest.raises(ValueError, match="chunk_bytes=1000"):
        IOPool(2, 1000)


def test_checksum_changes_with_any_byte():
    b = aligned_empty(3 << 20)
    h = checksum(b)
    for pos in (0, (1 << 20) - 1, 1 << 20, (3 << 20) - 1):
        b[pos] ^= 1
        assert checksum(b) != h
        b[pos] ^= 1
    assert checksum(b) == h


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=40))
def test_free_list_never_overlaps_and_coalesces(ops):
    fl = FreeList(64 * ALIGN)
    live: list[tuple[int, int]] = []
    for alloc, n in ops:
        if alloc or not live:
            off = fl.alloc(n)
            if off is None:
                assert fl.largest_free < -(-n // ALIGN) * ALIGN
                continue
            size = -(-n // ALIGN) * ALIGN
            assert off % ALIGN == 0 and off + size <= fl.capacity
            assert all(off + size <= o or o + s <= off for o, s in live)
            live.append((off, size))
        else:
            off, size = live.pop(0)
            fl.free(off, size)
        assert fl.free_bytes == fl.capacity - sum(s for _, s in live)
    for off, size in live:
        fl.free(off, size)
    assert fl.largest_free == fl.capacity  # everything coalesced back into one range


def test_free_list_double_free_and_take():
    fl = FreeList(4 * ALIGN)
    a = fl.alloc(ALIGN)
    fl.free(a, ALIGN)
    with pytest.raises(ValueError, match="double free"):
        fl.free(a, ALIGN)
    fl.take(ALIGN, ALIGN)
    assert fl.alloc(2 * ALIGN) == 2 * ALIGN and fl.alloc(ALIGN) == 0 and fl.alloc(1) is None
    with pytest.raises(ValueError, match="not free"):
        fl.take(0, ALIGN)


def test_free_list_shrinks_only_over_free_space():
    fl = FreeList(8 * ALIGN)
    a, b = fl.alloc(2 * ALIGN), fl.alloc(ALIGN)
    assert fl.end_of_allocations == 3 * ALIGN
    with pytest.raises(ValueError, match="not free"):
        fl.shrink(2 * ALIGN)  # would cut the allocated [2, 3)
    fl.shrink(5 * ALIGN)
    assert fl.capacity == 5 * ALIGN and fl.free_ranges() == [(3 * ALIGN, 2 * ALIGN)]
    fl.shrink(3 * ALIGN)
    assert fl.free_ranges() == [] and fl.end_of_allocations == 3 * ALIGN and fl.alloc(1) is None
    fl.free(b, ALIGN)
    assert fl.end_of_allocations == 2 * ALIGN
    fl.grow(4 * ALIGN)  # grows again after a shrink, the freed tail merged
    assert fl.free_ranges() == [(2 * ALIGN, 2 * ALIGN)] and a == 0


def test_arena_slabs_are_lazy_and_views_are_typed():
    made = []
    arena = Arena(10 * ALIGN, lambda n: made.append(n) or aligned_empty(n), slab_bytes=4 * ALIGN)
    assert arena.slab_sizes == [4 * ALIGN, 4 * ALIGN, 2 * ALIGN] and made == []
    b1 = arena.alloc(3 * ALIGN)
    b2 = arena.alloc(3 * ALIGN)  # does not fit in slab 0's remaining 1 page
    assert (b1.slab, b2.slab) == (0, 1) and made == [4 * ALIGN, 4 * ALIGN]
    assert arena.alloc(5 * ALIGN) is None and arena.held == 6 * ALIGN
    v = arena.view(b1, (3, 5), torch.bfloat16)
    v.fill_(1.5)
    assert v.dtype == torch.bfloat16 and torch.all(arena.view(b1, (15,), torch.bfloat16) == 1.5)
    arena.free(b1)
    arena.free(b2)
    assert arena.held == 0


def test_cpu_device_copies_and_measures():
    dev = Device("cpu")
    assert not dev.is_accelerator
    if not torch.cuda.is_available():
        assert list_devices() == []
    a, b = dev.alloc_host_slab(8192), dev.alloc_device_slab(8192)
    a.fill_(7)
    dev.copy_async(b, a).result()
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    h2d, d2h = measure_copy_gbps(dev, nbytes=1 << 20, seconds=0.05)
    assert h2d > 0 and d2h > 0
    dev.close()
    with pytest.raises(ValueError, match="'tpu'"):
        Device("tpu")


def test_package_exports_are_lazy():
    import subprocess
    code = ("import sys, outcore.offload as o; assert 'torch' not in sys.modules; "
            "from outcore.offload import TieredStore, Tier, ZOBlockTrainer, probe_hardware, SwapDir; "
            "print(Tier.NVME.name)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "NVME"


def test_device_round_trip_through_pinned_host(tmp_path, compute_device):
    """NVMe -> DEVICE and back passes through pinned HOST memory; once a copy has landed its
    HOST staging copy is freed."""
    from outcore.offload.device import is_accelerator
    from outcore.offload.store import Tier, TieredStore

    if not is_accelerator(compute_device):
        pytest.skip("a CPU's DEVICE tier is RAM: its copies are not staged through the HOST tier")
    with TieredStore(64 << 20, 64 << 20, swap_dir=tmp_path / "s", device=Device(compute_device)) as s:
        x = torch.randn(1000, 37)
        h = s.register("x", data=x)  # home: NVMe
        d = s.fetch(h, "device").result()
        assert d.device == compute_device and torch.equal(d.cpu(), x)
        assert s.held(Tier.HOST) == 0  # the staging copy is freed once the device copy landed
        d.mul_(3)
        s.mark_dirty(h, "device")
        s.write_back(h).result()
        assert s.held(Tier.HOST) == 0  # device -> disk staged through HOST, then freed
        s.release(h, "device")
        s.evict(h, "device").result()
        assert torch.equal(s.load(h), x * 3)
