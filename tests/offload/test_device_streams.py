"""offload/device.py's stream helpers: what the activation offloader's copies rely on."""
from __future__ import annotations

import pytest
import torch

from outcore.offload.device import SideStreams, compute_event, synchronize_device


def test_cpu_needs_no_event_and_no_sync():
    assert compute_event(torch.device("cpu")) is None
    assert compute_event(None) is None
    synchronize_device(torch.device("cpu"))  # nothing queued: returns at once


@pytest.mark.gpu
def test_side_stream_copies_see_compute_and_hand_back():
    from outcore.offload.device import hand_to_compute

    dev = torch.device("cuda")
    streams = SideStreams()
    x = torch.randn(1 << 20, device=dev)
    y = x * 2  # queued on the compute stream
    ready = compute_event(dev)
    host = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    streams.run_after(ready, dev, lambda: host.copy_(y, non_blocking=True))
    assert torch.equal(host, (x * 2).cpu())  # the side stream waited for y, the thread for the copy
    back, copied = streams.to_device(host, dev)
    hand_to_compute(back, copied)
    assert torch.equal(back, y)
    assert streams._stream(dev) is streams._stream(dev)  # one side stream per device


def test_side_stream_is_made_on_first_use_only():
    assert SideStreams()._streams == {}  # no CUDA work at construction (or import)
