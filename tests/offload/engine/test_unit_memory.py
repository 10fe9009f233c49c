"""The unit memory's residency: one pin per consumer, write-back at the last release, prefetch
hiding the disk, stalls counted once by the store."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch
from torch import nn

from outcore.offload.engine import WEIGHTS, ParamSlot, Part, StoreUnitMemory, Unit
from outcore.offload.store import Residency, Tier, TieredStore
from outcore.offload.store._futures import then

N = 4096  # elements per unit: one 16 KiB extent


def _units(n: int) -> list[Unit]:
    units = []
    for i in range(n):
        p = nn.Parameter(torch.full((N,), float(i)))
        units.append(Unit(index=i, name=f"block.{i}", modules=[], slots=[ParamSlot(f"p{i}", p, 0, p.shape)],
                          numel=N))
    return units


@pytest.fixture
def memory(tmp_path):
    """Makes unit memories over stores with room for ``device_units`` units in DEVICE."""
    made: list[StoreUnitMemory] = []

    def make(n: int = 6, device_units: int = 3) -> StoreUnitMemory:
        store = TieredStore(device_bytes=device_units * N * 4, host_bytes=4096,
                            swap_dir=tmp_path / f"swap{len(made)}")
        made.append(StoreUnitMemory(store, _units(n), None, home=Tier.NVME))
        return made[-1]
    yield make
    for mem in made:
        mem.flush()
        mem.store.close()


def test_one_store_pin_per_consumer_and_the_prefetch_pin_is_adopted(memory):
    mem = memory()
    h = mem.units[0].layout.handles[Part(WEIGHTS)]
    mem.prefetch(0, WEIGHTS)
    assert h.copies[Tier.DEVICE].pins == 1 and mem.pins(0) == 0  # held for the consumer to come
    w = mem.acquire(0, WEIGHTS)
    assert h.copies[Tier.DEVICE].pins == 1 and mem.pins(0) == 1  # the prefetch's pin, adopted
    assert torch.equal(w, torch.zeros(N))  # unit 0's weights
    mem.acquire(0, WEIGHTS)
    assert mem.pins(0) == 2
    mem.release(0, WEIGHTS, dirty=False)
    mem.release(0, WEIGHTS, dirty=False, keep=True)
    assert mem.pins(0) == 0 and h.residency(Tier.DEVICE) is Residency.RESIDENT  # kept
    mem.acquire(1, WEIGHTS)
    mem.release(1, WEIGHTS, dirty=False)  # not kept: evicted
    mem.flush()
    assert mem.units[1].layout.handles[Part(WEIGHTS)].residency(Tier.DEVICE) is Residency.ABSENT


def test_a_changed_copy_is_written_home_when_its_last_consumer_lets_go(memory):
    mem = memory()
    written = lambda: mem.store.tier_stats()["NVME"].written_bytes  # noqa: E731
    w = mem.acquire(2, WEIGHTS)
    mem.acquire(2, WEIGHTS)  # a second consumer (a tied weight's other user)
    before = written()
    w.add_(1.0)
    mem.release(2, WEIGHTS, dirty=True)
    mem.flush()
    assert written() == before  # still held: another consumer may change it again
    assert mem.units[2].layout.handles[Part(WEIGHTS)].dirty_tier is Tier.DEVICE
    mem.release(2, WEIGHTS, dirty=False)
    mem.flush()
    assert written() > before
    assert torch.equal(mem.weights(2), torch.full((N,), 3.0))  # 2 + 1, read back from the disk


def _slow_copies(mem: StoreUnitMemory, monkeypatch, delay: float) -> None:
    """Every transfer lands ``delay`` seconds late (a slow disk, deterministically)."""
    real = mem.store.moves.copy

    def slow(h, src, dst, durable=False):
        def later(_):
            g = Future()
            threading.Timer(delay, g.set_result, args=(None,)).start()
            return g
        return then(real(h, src, dst, durable), later)
    monkeypatch.setattr(mem.store.moves, "copy", slow)


def _pass(mem: StoreUnitMemory, depth: int, delay: float) -> float:
    """Visit every unit in order, computing ``delay`` s on each, prefetching ``depth`` ahead;
    returns the stall the store counted."""
    stall0, n = mem.store.stall_s, len(mem.units)
    for i in range(n):
        for j in range(i + 1, min(n, i + 1 + depth)):
            mem.prefetch(j, WEIGHTS)
        mem.acquire(i, WEIGHTS)
        time.sleep(delay)  # the compute the transfers overlap with
        mem.release(i, WEIGHTS, dirty=False)
    mem.flush()
    return mem.store.stall_s - stall0


def test_prefetch_hides_the_disk_and_the_store_counts_the_stall(memory, monkeypatch):
    delay = 0.05
    alone, ahead = memory(), memory()
    _slow_copies(alone, monkeypatch, delay)
    _slow_copies(ahead, monkeypatch, delay)
    exposed = _pass(alone, depth=0, delay=delay)
    hidden = _pass(ahead, depth=2, delay=delay)
    assert exposed >= 6 * delay * 0.9  # every acquire waited for its own read
    assert hidden < 0.5 * exposed  # only the first read is exposed (about 1/6)
