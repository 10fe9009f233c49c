"""TieredStore: round trips through every tier, budgets, dirty/write-back, accounting."""
from __future__ import annotations

import ctypes
import gc
import os
import random
import threading

import psutil
import pytest
import torch

from outcore.errors import BudgetError
from outcore.offload.aligned import align_up
from outcore.offload.store import Residency, Tier, TieredStore

MiB = 1 << 20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8]
SHAPES = [(1,), (3, 5), (1023,), (4097,), (257, 129)]  # odd sizes, none a multiple of 4 KiB


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.fixture
def store(tmp_path):
    s = TieredStore(device_bytes=8 * MiB, host_bytes=8 * MiB, nvme_bytes=32 * MiB,
                    swap_dir=tmp_path / "swap", device="cpu")
    yield s
    s.close()


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_tier_bit_exact(store, dtype):
    for i, shape in enumerate(SHAPES):
        x = _rand(shape, dtype, seed=i)
        h = store.register(f"t{i}", data=x)  # -> NVME
        host = store.fetch(h, Tier.HOST).result()  # NVME -> HOST
        assert torch.equal(_bits(host), _bits(x))
        store.release(h, Tier.HOST)
        dev = store.fetch(h, Tier.DEVICE).result()  # HOST -> DEVICE
        assert torch.equal(_bits(dev), _bits(x)) and dev.dtype == dtype and tuple(dev.shape) == shape
        y = _rand(shape, dtype, seed=100 + i)
        dev.copy_(y)
        store.mark_dirty(h, Tier.DEVICE)  # the HOST copy is stale now and dropped
        assert h.residency(Tier.HOST) is Residency.ABSENT
        store.write_back(h).result()  # DEVICE -> NVME
        store.release(h, Tier.DEVICE)
        store.evict(h, Tier.DEVICE).result()
        assert h.residency(Tier.DEVICE) is Residency.ABSENT
        assert torch.equal(_bits(store.load(h)), _bits(y))  # read from the disk
        dev2 = store.fetch(h, Tier.DEVICE).result()  # NVME -> DEVICE directly
        assert torch.equal(_bits(dev2), _bits(y))
        store.release(h, Tier.DEVICE)
        store.unregister(h)
    for t in Tier:
        assert store.held(t) == 0


def test_host_home_round_trip(store):
    x = _rand((333,), torch.bfloat16)
    h = store.register("w", data=x, home="host")
    assert store.held(Tier.NVME) == 0 and store.held(Tier.HOST) == align_up(x.nbytes)
    d = store.fetch(h, "device").result()
    d.mul_(2)
    store.mark_dirty(h, "device")
    store.write_back(h).result()
    assert torch.equal(store.view(h, "host"), x * 2)
    assert h.residency(Tier.DEVICE) is Residency.RESIDENT  # clean after write-back


def test_unwritten_tensor_starts_as_zeros_and_is_dirty(store):
    h = store.register("m", (5, 7), torch.float32)
    assert h.residency(Tier.NVME) is Residency.ABSENT  # no I/O until first written back
    t = store.fetch(h, "host").result()
    assert torch.equal(t, torch.zeros(5, 7)) and h.residency("host") is Residency.DIRTY
    store.release(h, "host")
    store.evict(h, "host").result()  # writes back first
    assert h.residency(Tier.NVME) is Residency.RESIDENT
    assert torch.equal(store.load(h), torch.zeros(5, 7))


def test_budget_too_small_for_largest_tensor(tmp_path):
    with TieredStore(device_bytes=64 * 1024, host_bytes=1 * MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        h = s.register("big.weight", data=torch.zeros(100_000))  # 400 kB > 64 KiB DEVICE
        with pytest.raises(BudgetError) as e:
            s.fetch(h, Tier.DEVICE)
        msg = str(e.value)
        assert "DEVICE" in msg and "big.weight" in msg and "64.0 KiB" not in msg
        assert "0.1 MiB" in msg or "0.06" in msg  # the budget, in MiB
        assert "requested" in msg and "held" in msg
        assert h.residency(Tier.DEVICE) is Residency.ABSENT and s.held(Tier.DEVICE) == 0
        with pytest.raises(BudgetError, match="HOST tier budget"):
            s.register("huge", data=torch.zeros(1_000_000), home="host")


def test_budget_full_names_what_is_held(store):
    a = store.register("a", data=torch.zeros(1536 * 1024))  # 6 MiB
    b = store.register("b", data=torch.zeros(768 * 1024))  # 3 MiB
    store.fetch(a, Tier.DEVICE).result()
    with pytest.raises(BudgetError,
                       match=r"DEVICE tier budget 8.0 MiB cannot hold 'b' \(3.0 MiB requested, 6.0 MiB held"):
        store.fetch(b, Tier.DEVICE)
    store.release(a, Tier.DEVICE)
    store.evict(a, Tier.DEVICE).result()
    assert torch.equal(store.fetch(b, Tier.DEVICE).result(), torch.zeros(768 * 1024))


def test_nvme_budget_is_reserved_and_enforced(tmp_path):
    with TieredStore(MiB, MiB, nvme_bytes=2 * MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        assert os.path.getsize(s.nvme.path) == 2 * MiB  # posix_fallocate up front
        s.register("a", data=torch.zeros(MiB // 4 * 3 // 2))  # 1.5 MiB
        with pytest.raises(BudgetError, match="NVME tier budget 2.0 MiB"):
            s.register("b", data=torch.zeros(MiB // 4))


def test_misuse_errors(store):
    h = store.register("x", data=torch.ones(10))
    with pytest.raises(ValueError, match="already registered"):
        store.register("x", data=torch.ones(10))
    with pytest.raises(ValueError, match="expected"):
        store.register("y", (3,), torch.float32, data=torch.ones(4))
    with pytest.raises(ValueError, match="home"):
        store.register("z", (3,), torch.float32, home="device")
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        store.fetch(h, "gpu")
    with pytest.raises(ValueError, match="fetch and wait first"):
        store.view(h, "device")
    store.fetch(h, "device").result()
    with pytest.raises(ValueError, match="pinned by 1"):
        store.evict(h, "device")
    with pytest.raises(ValueError, match="home copy"):
        store.evict(h, "nvme")
    store.release(h, "device")
    with pytest.raises(ValueError, match="without a matching fetch"):
        store.release(h, "device")


def test_tier_stats_count_bytes(store):
    x = torch.arange(1000, dtype=torch.float32)
    h = store.register("x", data=x)
    store.fetch(h, "device").result()
    st = store.tier_stats(window=True)
    n = align_up(x.nbytes)
    assert st["NVME"].written_bytes == n and st["NVME"].read_bytes == n
    assert st["DEVICE"].written_bytes == n and st["DEVICE"].held_bytes == n
    assert st["DEVICE"].budget_bytes == 8 * MiB and st["NVME"].budget_bytes == 32 * MiB
    assert st["NVME"].read_gbps > 0


def test_stress_concurrent_fetch_evict_never_exceeds_budgets(tmp_path):
    """Many threads fetch, modify, write back and evict; budgets hold at every instant."""
    budgets = {Tier.DEVICE: 6 * MiB, Tier.HOST: 6 * MiB}
    proc = psutil.Process()
    gc.collect()
    with TieredStore(budgets[Tier.DEVICE], budgets[Tier.HOST], nvme_bytes=64 * MiB,
                     swap_dir=tmp_path / "s", device="cpu") as s:
        sizes = [random.Random(i).randint(1, 400_000) for i in range(24)]
        hs = [s.register(f"h{i}", data=torch.full((n,), float(i))) for i, n in enumerate(sizes)]
        for t in (Tier.DEVICE, Tier.HOST):  # materialize the slabs before the RSS baseline
            h0 = hs[0]
            s.fetch(h0, t).result()
            s.release(h0, t)
            s.evict(h0, t).result()
        rss0 = proc.memory_info().rss
        peak = {t: 0 for t in Tier}
        violations, errors = [], []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                for t, b in budgets.items():
                    held = s.held(t)
                    peak[t] = max(peak[t], held)
                    if held > b:
                        violations.append((t, held))
                stop.wait(0.0005)

        def worker(seed):
            rng = random.Random(seed)
            for _ in range(60):
                h, tier = rng.choice(hs), rng.choice([Tier.DEVICE, Tier.HOST])
                try:
                    v = s.fetch(h, tier).result()
                except BudgetError:
                    continue
                except ValueError as e:  # racing mark_dirty on a copy in flight: allowed to refuse
                    errors.append(e)
                    continue
                assert v.numel() == h.numel
                try:
                    if rng.random() < 0.3:
                        s.mark_dirty(h, tier)
                        s.write_back(h).result()
                except ValueError:
                    pass
                s.release(h, tier)
                try:
                    s.evict(h, tier).result()
                except ValueError:
                    pass  # pinned by another worker

        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        sampler.join()
        s.synchronize()
        assert not violations
        assert peak[Tier.DEVICE] > 0 and peak[Tier.HOST] > 0
        # Arenas are preallocated: the work itself adds no memory beyond them.
        assert proc.memory_info().rss - rss0 < 16 * MiB
        for i, h in enumerate(hs):  # and every value survived
            assert torch.equal(s.load(h), torch.full((sizes[i],), float(i)))
        for t in (Tier.DEVICE, Tier.HOST):
            for h in hs:
                if h.copies[t].valid:
                    assert h.copies[t].pins == 0
                    s.evict(h, t).result()
            assert s.held(t) == 0


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages in physical memory, by ``mincore(2)``: blind to the rest of the process,
    whose RSS other tests' freed memory moves by tens of MiB either way."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * page


def test_held_equals_sum_of_resident_blocks_and_the_slab_is_resident(tmp_path):
    """Store accounting against physical memory: the arena is touched when created, and is all there is."""
    with TieredStore(64 * MiB, 0, swap_dir=tmp_path / "s", device="cpu") as s:
        h = s.register("x", data=torch.ones(4 * MiB))  # 16 MiB
        s.fetch(h, "device").result()
        assert s.held(Tier.DEVICE) == 16 * MiB
        slabs = [t for t in s.space.arenas[Tier.DEVICE]._slabs if t is not None]
        assert sum(t.numel() for t in slabs) == s.budget(Tier.DEVICE)  # bounded: one budget of slabs
        assert sum(_resident_bytes(t) for t in slabs) == s.budget(Tier.DEVICE)  # and every page is real
        s.release(h, "device")


def test_durable_write_back_syncs_data_before_journal(store, monkeypatch):
    from outcore.offload.store import nvme as nvme_mod
    calls = []
    real = nvme_mod.os.fdatasync
    monkeypatch.setattr(nvme_mod.os, "fdatasync", lambda fd: (calls.append(fd), real(fd))[1])
    h = store.register("ckpt", data=torch.ones(100))
    assert calls == []  # ordinary swap writes are not synced
    t = store.fetch(h, "host").result()
    t.add_(1)
    store.mark_dirty(h, "host")
    store.write_back(h, durable=True).result()
    assert calls == [store.nvme.fd, store.nvme._ifd]  # data first, then the journal line
    store.release(h, "host")
    assert torch.equal(store.load(h), torch.full((100,), 2.0))


def test_tier_stats_fill_a_step_event(store):
    from outcore.events import StepEvent
    h = store.register("x", data=torch.ones(10))
    store.fetch(h, "device").result()
    ev = StepEvent(step=1, total_steps=1, loss=0.0, lr=0.0, tokens_per_s=0.0, step_s=0.0,
                   elapsed_s=0.0, rss_bytes=0, stall_s=store.stall_s, tiers=store.tier_stats())
    assert set(ev.to_json()["tiers"]) == {"DEVICE", "HOST", "NVME"}
    assert ev.tiers["DEVICE"].held_bytes == 4096


def test_evict_waits_for_a_transfer_reading_the_copy(store, monkeypatch):
    """Regression: evicting a HOST copy while it is being copied to DEVICE must not reuse its bytes."""
    import time as _time
    x = torch.arange(50_000, dtype=torch.float32)
    h = store.register("x", data=x)
    store.fetch(h, "host").result()
    store.release(h, "host")
    real = store.device.copy_async
    gate = threading.Event()

    def slow_copy(dst, src):
        def run():
            gate.wait(5)
            return dst.copy_(src)
        return store.device._copier.submit(run)
    monkeypatch.setattr(store.device, "copy_async", slow_copy)
    fut = store.fetch(h, "device")  # HOST -> DEVICE, held at the gate
    ev = store.evict(h, "host")
    _time.sleep(0.05)
    assert not ev.done() and h.residency("host") is Residency.RESIDENT  # still read by the copy
    monkeypatch.setattr(store.device, "copy_async", real)
    gate.set()
    assert torch.equal(fut.result(), x)
    ev.result()
    assert h.residency("host") is Residency.ABSENT
    other = store.register("y", data=torch.zeros(50_000), home="host")  # may reuse the freed block
    assert torch.equal(store.view(h, "device"), x) and torch.equal(store.view(other, "host"), torch.zeros(50_000))


def test_traffic_counts_moves_and_windows():
    from outcore.offload.store import TierTraffic
    tr = TierTraffic()
    tr.moved(Tier.NVME, Tier.DEVICE, 8192)
    tr.wrote(Tier.NVME, 4096)
    assert tr.totals(Tier.NVME) == (8192, 4096) and tr.totals(Tier.DEVICE) == (0, 8192)
    held = {Tier.DEVICE: 8192, Tier.HOST: 0, Tier.NVME: 4096}
    budget = {Tier.DEVICE: MiB, Tier.HOST: 0, Tier.NVME: None}
    st = tr.stats(held.get, budget.get, window=True)
    assert st["DEVICE"].written_bytes == 8192 and st["DEVICE"].held_bytes == 8192
    assert st["NVME"].budget_bytes == 0 and st["NVME"].read_gbps > 0  # unbounded reads as 0
    again = tr.stats(held.get, budget.get, window=True)  # a new window: nothing moved since
    assert again["NVME"].read_gbps == 0 and again["NVME"].read_bytes == 8192


def test_failed_transfer_is_not_counted(store, monkeypatch):
    h = store.register("x", data=torch.ones(1000))
    before = store.tier_stats()["NVME"].read_bytes
    monkeypatch.setattr(store.nvme, "read", lambda ext, dst: _failed(OSError(5, "EIO")))
    with pytest.raises(OSError):
        store.fetch(h, "host").result()
    assert store.tier_stats()["NVME"].read_bytes == before and store.held(Tier.HOST) == 0


def _failed(exc):
    from concurrent.futures import Future
    f = Future()
    f.set_exception(exc)
    return f


def test_budget_error_names_fragmentation(tmp_path):
    with pytest.raises(BudgetError, match="host_bytes=-1"):
        TieredStore(device_bytes=MiB, host_bytes=-1, device="cpu")
    quarter = MiB // 4 // 4  # float32 elements in 256 KiB
    with TieredStore(device_bytes=3 * MiB // 4, host_bytes=0, swap_dir=tmp_path / "s", device="cpu") as s:
        hs = [s.register(f"t{i}", data=torch.full((quarter,), float(i))) for i in range(3)]
        for h in hs:
            s.fetch(h, "device").result()
            s.release(h, "device")
        for h in (hs[0], hs[2]):
            s.evict(h, "device").result()
        big = s.register("big", data=torch.zeros(2 * quarter))  # 512 KiB: as much as is free, in two holes
        with pytest.raises(BudgetError, match=r"'big' \(0.5 MiB requested, 0.2 MiB held, largest free block 0.2 MiB"):
            s.fetch(big, "device")


def test_large_blocks_come_from_the_top_so_small_ones_cannot_split_them():
    """Regression: a HOST window of 2 large moments + small block states failed first-fit."""
    from outcore.offload.aligned import ALIGN, aligned_empty
    from outcore.offload.store.arena import Arena, FreeList
    arena = Arena(10 * ALIGN, aligned_empty, large_fraction=0.3)  # >= 3 pages is large
    small = [arena.alloc(ALIGN) for _ in range(3)]  # bottom: pages 0..2
    big1 = arena.alloc(4 * ALIGN)
    assert big1.offset == 6 * ALIGN and all(b.offset < 3 * ALIGN for b in small)
    for b in small:
        arena.free(b)
    big2 = arena.alloc(4 * ALIGN)  # first-fit would have put big1 at page 3: 3 + 3 pages free, no 4
    assert big2 is not None and big2.offset == 2 * ALIGN
    fl = FreeList(8 * ALIGN)
    assert fl.alloc(ALIGN, high=True) == 7 * ALIGN and fl.alloc(ALIGN) == 0
    assert fl.alloc(6 * ALIGN, high=True) == ALIGN and fl.alloc(1, high=True) is None
    fl.free(ALIGN, 6 * ALIGN)
    fl.free(0, ALIGN)
    fl.free(7 * ALIGN, ALIGN)
    assert fl.largest_free == fl.capacity  # coalesced back into one range
    with pytest.raises(ValueError, match="large_fraction=1.5"):
        Arena(ALIGN, aligned_empty, large_fraction=1.5)


def test_free_list_high_and_low_allocations_never_overlap():
    from outcore.offload.aligned import ALIGN
    from outcore.offload.store.arena import FreeList
    rng = random.Random(7)
    fl, live = FreeList(64 * ALIGN), []
    for _ in range(400):
        if live and rng.random() < 0.45:
            fl.free(*live.pop(rng.randrange(len(live))))
        else:
            n = rng.randint(1, 6 * ALIGN)
            off = fl.alloc(n, high=rng.random() < 0.5)
            if off is None:
                assert fl.largest_free < align_up(n)
                continue
            size = align_up(n)
            assert off % ALIGN == 0 and off + size <= fl.capacity
            assert all(off + size <= o or o + s <= off for o, s in live)
            live.append((off, size))
        assert fl.free_bytes == fl.capacity - sum(s for _, s in live)
