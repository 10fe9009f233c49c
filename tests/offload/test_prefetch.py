"""PrefetchQueue: order-driven prefetch, Belady eviction, stall accounting."""
from __future__ import annotations

import threading

import pytest
import torch

from outcore.errors import BudgetError
from outcore.offload._futures import then
from outcore.offload.handle import Residency, Tier
from outcore.offload.prefetch import PrefetchQueue
from outcore.offload.store import TieredStore

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def store(tmp_path):
    s = TieredStore(device_bytes=64 * KiB, host_bytes=MiB, nvme_bytes=8 * MiB,
                    swap_dir=tmp_path / "swap", device="cpu")
    yield s
    s.close()


def _blocks(store, n, numel=4096):  # 16 KiB each: the DEVICE tier holds 4
    return [store.register(f"block{i}", data=torch.full((numel,), float(i))) for i in range(n)]


def test_forward_backward_order_values_and_budget(store):
    hs = _blocks(store, 6)
    order = hs + hs[::-1]  # forward 0..5, backward 5..0
    pq = PrefetchQueue(store, order, Tier.DEVICE, depth=2)
    for h in order:
        t = pq.get(h)
        assert torch.equal(t, torch.full((4096,), float(hs.index(h))))
        assert store.held(Tier.DEVICE) <= 64 * KiB
        pq.done(h)
    pq.close()
    assert store.held(Tier.DEVICE) == 0


def test_order_mismatch_and_exhaustion(store):
    hs = _blocks(store, 2)
    pq = PrefetchQueue(store, hs, depth=1)
    with pytest.raises(ValueError, match="expected 'block0', got 'block1'"):
        pq.get(hs[1])
    pq.get(hs[0]); pq.done(hs[0])
    pq.get(); pq.done(hs[1])
    with pytest.raises(ValueError, match="exhausted after 2"):
        pq.get()
    with pytest.raises(ValueError, match="non-empty"):
        PrefetchQueue(store, [])


def test_evicts_the_farthest_next_use(tmp_path, monkeypatch):
    with TieredStore(32 * KiB, MiB, swap_dir=tmp_path / "s", device="cpu") as s:  # room for 2 blocks
        a, b, c = _blocks(s, 3)
        evicted = []
        real = s.evict
        monkeypatch.setattr(s, "evict", lambda h, tier, **k: (evicted.append(h.key), real(h, tier, **k))[1])
        order = [a, b, c, a, b]
        pq = PrefetchQueue(s, order, Tier.DEVICE, depth=0)
        for h in order:
            pq.get(h)
            pq.done(h)
        # Room for c: LRU would drop a (used longest ago); Belady drops b, whose next
        # use (4) is after a's (3), so a is still there at position 3.
        assert evicted == ["block1", "block0"]


def test_dirty_updates_are_written_back_under_pressure(store):
    hs = _blocks(store, 10)  # 160 KiB of state through a 64 KiB tier
    pq = PrefetchQueue(store, hs, Tier.DEVICE, depth=2, cyclic=True)
    for _step in range(3):
        for h in hs:
            pq.get(h).add_(1)
            pq.done(h, dirty=True)
    pq.close()
    for i, h in enumerate(hs):
        assert torch.equal(store.load(h), torch.full((4096,), float(i + 3)))
        assert h.residency(Tier.DEVICE) is Residency.ABSENT


def test_tensor_larger_than_tier_raises_budget_error(store):
    big = store.register("huge", data=torch.zeros(64 * KiB))  # 256 KiB > 64 KiB
    pq = PrefetchQueue(store, [big], depth=1)
    with pytest.raises(BudgetError, match="DEVICE tier budget 0.1 MiB cannot hold 'huge'"):
        pq.get(big)


def _slow_copies(store, monkeypatch, delay):
    """Every transfer lands `delay` seconds late (a slow disk, deterministically)."""
    real = store.moves.copy

    def slow(h, src, dst):
        f = real(h, src, dst)

        def later(_):
            from concurrent.futures import Future
            g = Future()
            threading.Timer(delay, g.set_result, args=(None,)).start()
            return g
        return then(f, later)
    monkeypatch.setattr(store.moves, "copy", slow)


def test_stall_is_measured_and_prefetch_hides_it(store, monkeypatch):
    """Same slow transfers, same compute: prefetching 2 ahead hides most of the wait."""
    hs = _blocks(store, 6)
    delay = 0.05
    _slow_copies(store, monkeypatch, delay)
    stall = {}
    for depth in (0, 2):
        pq = PrefetchQueue(store, hs, depth=depth)
        for h in hs:
            pq.get(h)
            threading.Event().wait(delay * 1.2)  # "compute" longer than one transfer
            pq.done(h)
        pq.close()  # empties the tier: the second run starts cold too
        stall[depth] = pq.stall_s
    assert stall[0] >= 6 * delay * 0.9  # every get waited for its own transfer
    assert stall[2] < 0.5 * stall[0]  # only the first transfer is exposed (≈ 1/6)
