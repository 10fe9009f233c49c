"""offload/simdevice.py: the simulated accelerator fails where a GPU fails.

Each test pins one behaviour a GPU has and a CPU lacks; it would pass on a plain CPU
"device" only if that behaviour were missing from the simulator.
"""
from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from outcore.offload import simdevice
from outcore.offload.aligned import aligned_empty

pytestmark = pytest.mark.skipif(not simdevice.available(),
                                reason="the sim device needs a C++ compiler and ninja to build")
if simdevice.available():
    simdevice.load()  # at collection: before any test of the session runs a backward pass

NAN_BITS = 0xFFFFFFFF  # fp32 poison, as read back through a raw pointer


@pytest.fixture(scope="module")
def dev():
    return simdevice.enable()


@pytest.fixture(autouse=True)
def _drained(dev):
    """Each test starts and ends with every stream's work done."""
    torch.accelerator.synchronize()
    yield
    torch.accelerator.synchronize()


def _side():
    return torch.Stream(device="sim")


def _event(stream=None, timing=False):
    ev = torch.Event(device="sim", enable_timing=timing)
    ev.record(stream)
    return ev


def _word(address: int) -> int:
    return ctypes.c_uint32.from_address(address).value


# --- registration -----------------------------------------------------------------------
def test_enable_registers_a_real_accelerator(dev):
    assert simdevice.enable() == dev == torch.device("sim")
    assert torch.accelerator.current_accelerator() == torch.device("sim")
    assert torch.accelerator.is_available() and torch.accelerator.device_count() == 1
    x = torch.ones(3).sim()
    assert x.is_sim and x.device == torch.device("sim", 0)
    assert type(x) is torch.Tensor and torch.nn.Linear(2, 2).sim().weight.device.type == "sim"


# --- kernels ----------------------------------------------------------------------------
def test_ops_match_the_cpu_bit_for_bit(dev):
    torch.manual_seed(0)
    a, b = torch.randn(33, 17), torch.randn(17, 9)
    cpu = torch.nn.functional.gelu(a @ b).softmax(-1).sum(0)
    sim = torch.nn.functional.gelu(a.to(dev) @ b.to(dev)).softmax(-1).sum(0)
    assert sim.device.type == "sim" and torch.equal(sim.cpu(), cpu)
    # Random and factory ops draw from the CPU generator: a seeded run repeats the CPU's.
    torch.manual_seed(7)
    want = (torch.randn(5), torch.randint(0, 9, (4,)), torch.rand(3))
    torch.manual_seed(7)
    got = (torch.randn(5, device=dev), torch.randint(0, 9, (4,), device=dev), torch.rand(3, device=dev))
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    assert torch.equal(torch.arange(6, device=dev).cpu(), torch.arange(6))  # an out= that grows
    # Composites that branch on the device type (SDPA's kernel choice, convolution) take the
    # CPU's branch: same kernels, same bits.
    q = torch.randn(2, 4, 8, 16)
    assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
                       torch.nn.functional.scaled_dot_product_attention(*[q.to(dev)] * 3, is_causal=True).cpu())
    grads = []
    for device in ("cpu", dev):
        w = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
        torch.nn.functional.conv1d(torch.ones(2, 3, 9, device=device), w).square().sum().backward()
        grads.append(w.grad.cpu())
    assert torch.equal(*grads)


def test_views_alias_and_in_place_ops_return_the_same_tensor(dev):
    x = torch.zeros(4, 6, device=dev)
    x.view(24)[0] = 1
    x.t()[5, 3] = 2
    x.unfold(1, 2, 2)[1, 0, 1] = 3  # unfold runs through the fallback: still a view
    x[2:, ::2].fill_(4)
    want = torch.zeros(4, 6)
    want.view(24)[0] = 1
    want.t()[5, 3] = 2
    want[1, 1] = 3
    want[2:, ::2] = 4
    assert torch.equal(x.cpu(), want)
    assert x.add_(1) is x
    out = torch.empty(0, device=dev)
    assert torch.add(x, x, out=out) is out and out.shape == (4, 6)  # out= resized in place
    assert x.reshape(24).data_ptr() == x.data_ptr()


def test_param_data_can_point_into_device_buffers_and_back(dev):
    p = torch.nn.Parameter(torch.randn(2, 3))
    buf = torch.zeros(64, device=dev)
    p.data = buf[8:14].view(2, 3)  # the engine points parameters into device buffers
    assert p.device.type == "sim" and isinstance(p, torch.nn.Parameter)
    with torch.no_grad():
        p.fill_(5)
    assert torch.equal(buf[8:14].cpu(), torch.full((6,), 5.0))
    (p * 2).sum().backward()
    assert p.grad.device.type == "sim" and torch.equal(p.grad.cpu(), torch.full((2, 3), 2.0))
    p.data = torch.ones(2, 3)
    assert p.device.type == "cpu"


def test_mixing_devices_raises_as_on_cuda(dev):
    x = torch.randn(3, 4, device=dev)
    with pytest.raises(RuntimeError, match="same device, but found at least two devices, sim:0 and cpu"):
        x + torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="sim:0 and cpu.*aten::mm"):
        torch.mm(x, torch.randn(4, 2))
    with pytest.raises(RuntimeError, match="same device"):
        torch.add(x, 1, out=torch.tensor(0.0))  # a CPU output, even 0-dim
    # What CUDA allows: CPU scalars, CPU index tensors, copies.
    assert (x * torch.tensor(2.0)).device.type == "sim"
    idx = torch.tensor([0, 2])
    assert torch.equal(x[idx].cpu(), x.cpu()[idx])
    x[idx] = 0.0
    assert torch.equal(x.cpu()[idx], torch.zeros(2, 4))
    torch.empty(3, 4).copy_(x)


def test_tiny_llama_forward_backward_is_bit_identical(dev, tiny_llama_factory):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 24))
    runs = []
    for device in ("cpu", dev):
        model = tiny_llama_factory().to(device).train()
        out = model(input_ids=ids.to(device), labels=ids.to(device))
        out.loss.backward()  # on the autograd engine's sim device thread
        runs.append([out.logits.detach().cpu()] + [p.grad.cpu() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# --- memory -----------------------------------------------------------------------------
def test_new_and_freed_device_memory_is_poison(dev):
    assert torch.isnan(torch.empty(1000, device=dev)).all()
    grown = torch.ones(10, device=dev)
    grown.resize_(5000)
    assert torch.isnan(grown[10:]).all() and torch.equal(grown[:10].cpu(), torch.ones(10))
    x = torch.ones(1024, device=dev)
    address = x.data_ptr()
    assert _word(address) == 0x3F800000  # 1.0f
    del x  # the block stays cached (mapped), so the old address can be read
    assert _word(address) == NAN_BITS and _word(address + 4092) == NAN_BITS


def test_record_stream_keeps_freed_memory_until_its_stream_ran(dev):
    side = _side()
    host = torch.empty(1024).pin_memory()
    src = torch.full((1024,), 3.0, device=dev)
    ready = _event()
    with side:
        side.wait_event(ready)
        host.copy_(src, non_blocking=True)  # queued: reads src when it runs
    src.record_stream(side)
    address = src.data_ptr()
    del src
    again = torch.empty(1024, device=dev)
    assert again.data_ptr() != address  # not reused while the side stream may read it
    side.synchronize()
    assert torch.equal(host, torch.full((1024,), 3.0))


def test_a_queued_copy_of_freed_memory_is_a_use_after_free(dev):
    side = _side()
    host = torch.empty(1024).pin_memory()
    src = torch.ones(1024, device=dev)
    ready = _event()
    with side:
        side.wait_event(ready)
        host.copy_(src, non_blocking=True)
    del src  # no record_stream(side): the memory is back in the compute stream's pool
    with pytest.raises(RuntimeError, match="use after free"):
        side.synchronize()


def test_pinned_memory_and_host_register(dev):
    assert torch.empty(4096, pin_memory=True).is_pinned()
    assert torch.randn(10).pin_memory().is_pinned() and not torch.randn(10).is_pinned()
    buf = aligned_empty(3 * 4096)
    assert not buf.is_pinned()
    simdevice.host_register(buf)
    assert buf.is_pinned()
    with pytest.raises(RuntimeError, match="overlaps"):
        simdevice.host_register(buf)
    # A registered buffer is pinned for copies: non_blocking lands late, not at once.
    simdevice.reset_report()
    torch.empty(3 * 4096, dtype=torch.uint8, device=dev).copy_(buf, non_blocking=True)
    assert simdevice.report()["deferred_copies"] == 1
    simdevice.host_unregister(buf)
    assert not buf.is_pinned()
    with pytest.raises(RuntimeError, match="page-aligned"):
        simdevice.host_register(aligned_empty(4096)[1:])
    with pytest.raises(RuntimeError, match="not the start"):
        simdevice.host_unregister(buf)


# --- streams, events, late copies -------------------------------------------------------
def test_streams_and_events_through_the_generic_api(dev):
    default = torch.accelerator.current_stream()
    side = _side()
    assert default.stream_id == 0 and side.stream_id != 0 and side.device == torch.device("sim", 0)
    with side:
        assert torch.accelerator.current_stream() == side
    assert torch.accelerator.current_stream() == default
    torch.accelerator.set_stream(side)
    assert torch.accelerator.current_stream() == side
    torch.accelerator.set_stream(default)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(torch.accelerator.current_stream()))
    with side:  # the current stream is per thread
        worker.start()
        worker.join()
    assert seen == [default]
    start = _event(timing=True)
    torch.randn(64, 64, device=dev).sum()
    end = _event(timing=True)
    assert end.query() and start.elapsed_time(end) >= 0
    side.wait_stream(default)
    assert side.query()
    side.synchronize()
    torch.sim.synchronize()


def test_a_deferred_copy_lands_only_when_waited_for(dev):
    side = _side()
    x = torch.arange(1024, dtype=torch.float32, device=dev)
    ready = _event()
    host = torch.empty(1024).pin_memory()
    with side:
        side.wait_event(ready)
        host.copy_(x, non_blocking=True)
        done = _event(side)
    assert torch.isnan(host).all()  # the host read before waiting: poison
    done.synchronize()
    assert torch.equal(host, torch.arange(1024, dtype=torch.float32))

    back = torch.empty(1024, device=dev)
    with side:
        back.copy_(host, non_blocking=True)
        arrived = _event(side)
    with pytest.raises(RuntimeError, match="stream-order race"):
        back.sum()  # the compute stream reads before waiting
    torch.accelerator.current_stream().wait_event(arrived)
    assert torch.equal(back.cpu(), host)


def test_a_host_buffer_changed_before_the_copy_ran_changes_the_result(dev):
    host = torch.full((1024,), 1.0).pin_memory()
    x = torch.empty(1024, device=dev)
    x.copy_(host, non_blocking=True)
    host.fill_(2.0)  # reused before synchronizing: the copy has not read it yet
    assert torch.equal(x.cpu(), torch.full((1024,), 2.0))


def test_stream_order_runs_queued_copies_before_later_work(dev):
    host = torch.arange(1024, dtype=torch.float32).pin_memory()
    x = torch.empty(1024, device=dev)
    x.copy_(host, non_blocking=True)
    assert torch.equal((x + 1).cpu(), host + 1)  # a later kernel on the same stream
    y = torch.empty(1024, device=dev)
    y.copy_(host, non_blocking=True)
    assert y.sum().item() == host.sum().item()  # .item() waits for the stream


def test_race_detector_needs_an_event_between_streams(dev):
    side = _side()
    host = torch.ones(4096).pin_memory()
    buf = torch.zeros(4096, device=dev)
    torch.accelerator.synchronize()
    (buf * 2).sum()  # compute reads buf
    with side:  # a prefetch into the buffer compute may still be reading
        with pytest.raises(RuntimeError, match=r"on stream \d+ writes bytes \[0, 4096\).*"
                                               r"stream 0 \(the default stream\) read"):
            buf.copy_(host, non_blocking=True)
    computed = _event()
    with side:
        side.wait_event(computed)
        buf.copy_(host, non_blocking=True)

    grad = torch.ones(4096, device=dev) * 3  # compute writes it
    with side:  # a write-back that does not wait for compute
        with pytest.raises(RuntimeError, match="aten::mul.Tensor"):
            host.copy_(grad, non_blocking=True)
    written = _event()
    with side:
        side.wait_event(written)
        host.copy_(grad, non_blocking=True)
    side.synchronize()
    assert torch.equal(host, torch.full((4096,), 3.0))


def test_memory_freed_without_record_stream_races_its_reuse(dev):
    side = _side()
    x = torch.ones(1024, device=dev)
    ready = _event()
    with side:
        side.wait_event(ready)
        (x * 2).sum()  # a side-stream kernel reads x
    del x  # without record_stream the compute stream's next allocation may reuse it
    with pytest.raises(RuntimeError, match="stream-order race"):
        torch.ones(1024, device=dev)


def test_report_counts_copies_and_memory(dev):
    simdevice.reset_report()
    base = simdevice.report()["allocated_bytes"]
    x = torch.randn(1000).to(dev, non_blocking=True)  # pageable: synchronous on a GPU
    r = simdevice.report()
    assert r["pageable_non_blocking"] == 1 and r["deferred_copies"] == 0
    assert r["bytes_h2d"] == 4000 and r["allocated_bytes"] == base + 4096  # a page
    x.to("cpu", non_blocking=True)  # into pinned memory: deferred
    r = simdevice.report()
    assert r["deferred_copies"] == 1 and r["bytes_d2h"] == 4000 and r["pending_copies"] == 1
    del x
    assert simdevice.report()["peak_bytes"] >= base + 4096


@pytest.mark.skipif(not hasattr(torch.accelerator, "memory_stats"),
                    reason=f"torch {torch.__version__} has no torch.accelerator memory API")
def test_torch_accelerator_memory_calls_reach_the_allocator(dev):
    """accelerate's Trainer and friends call torch.accelerator's memory API on whatever accelerator
    is current; on CUDA it reaches the caching allocator, so here it must reach sim's."""
    torch.accelerator.empty_cache()
    base = torch.accelerator.memory_allocated()
    assert base == simdevice.report()["allocated_bytes"]
    x = torch.empty(1 << 20, device=dev)  # 4 MiB
    assert torch.accelerator.memory_allocated() == base + (4 << 20)
    assert torch.accelerator.memory_reserved() >= base + (4 << 20)
    del x
    assert torch.accelerator.max_memory_allocated() >= base + (4 << 20)
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated() == base
    torch.accelerator.empty_cache()  # the freed block goes back to the OS: reserved no longer counts it
    assert torch.accelerator.memory_reserved() == base


def test_threads_issue_copies_while_compute_runs(dev):
    """The engine's I/O threads copy on side streams while the main thread computes."""
    side = _side()
    host = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
    copies = []

    def io():
        with side:
            for _ in range(40):
                buf = torch.empty(1 << 16, device=dev)
                buf.copy_(host, non_blocking=True)
                copies.append((buf, _event(side)))

    worker = threading.Thread(target=io)
    worker.start()
    x = torch.randn(96, 96, device=dev)
    for _ in range(40):
        x = torch.tanh(x @ x)
    worker.join()
    compute = torch.accelerator.current_stream()
    for buf, copied in copies:
        compute.wait_event(copied)
        buf.record_stream(compute)  # allocated on the side stream, used on compute
        assert torch.equal(buf.cpu(), host)



def _run_alone(code: str) -> None:
    """Run ``code`` in a fresh process (a deadlock or a crash must not take the session with it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import outcore

    root = str(Path(outcore.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: the process stopped (see the test's docstring)")
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


_COPY_VS_RECORD = """
import threading, time
import torch
from outcore.offload import simdevice
dev = simdevice.enable()
side = torch.Stream(device=dev)
host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
stop = time.monotonic() + 1.0
def copier():
    torch.accelerator.set_stream(side)
    while time.monotonic() < stop:
        torch.empty(4096, dtype=torch.uint8, device=dev).copy_(host, non_blocking=True)
        side.synchronize()
worker = threading.Thread(target=copier)
worker.start()
while worker.is_alive():
    torch.Event(device=dev).record(side)  # holds the GIL while it takes the simulator's lock
print("ok")
"""


def test_a_copy_thread_and_event_records_on_the_main_thread_never_deadlock(dev):
    """A thread's non_blocking copy (the GIL released) and the main thread's Event.record (the
    GIL held) both take the simulator's lock: nothing done under it may take the GIL (with
    torch's PyObject refcounting, returning the copy's destination once did: a deadlock)."""
    _run_alone(_COPY_VS_RECORD)


_COPIES_ON_THREADS = """
import threading, time
import torch
from outcore.offload import simdevice
dev = simdevice.enable()
stop = time.monotonic() + 4.0
def copier():
    side = torch.Stream(device=dev)
    torch.accelerator.set_stream(side)
    d = torch.empty(1024, dtype=torch.uint8, device=dev)
    while time.monotonic() < stop:
        for _ in range(8):  # each host buffer's last reference is its queued copy's
            d.copy_(torch.empty(1024, dtype=torch.uint8, pin_memory=True), non_blocking=True)
        side.synchronize()  # the copies run: their host sides are released after the unlock
threads = [threading.Thread(target=copier) for _ in range(3)]
for t in threads: t.start()
for t in threads: t.join()
print("ok")
"""


def test_copy_threads_release_their_host_buffers_safely(dev):
    """The host sides of copies that ran wait, under the simulator's lock, to be released once it
    is unlocked; only that lock guards them (a lock of the pinned ranges, taken by every copy
    without the simulator's, once handed them out too: a crash within seconds on three threads)."""
    _run_alone(_COPIES_ON_THREADS)
