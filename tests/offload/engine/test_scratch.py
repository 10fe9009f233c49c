"""offload/engine/scratch.py: widened gradients equal ``g.to(float32)``, aligned, in one reused buffer."""
from __future__ import annotations

import torch

from outcore.offload.engine.scratch import ALIGN_ELEMENTS, WidenedGrads


def test_widened_gradients_equal_a_fresh_cast_and_reuse_one_buffer():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in [(3, 5), (7,), (2, 2, 9)]]
    widen = WidenedGrads()
    out = widen(grads, torch.float32)
    for a, b in zip(out, grads):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(a, b.to(torch.float32))  # bit for bit: the widening is exact
        assert a.data_ptr() % (4 * ALIGN_ELEMENTS) == out[0].data_ptr() % (4 * ALIGN_ELEMENTS)
    first = out[0].untyped_storage().data_ptr()
    assert all(a.untyped_storage().data_ptr() == first for a in out)  # one buffer
    smaller = widen(grads[:1], torch.float32)  # a smaller update reuses it
    assert smaller[0].untyped_storage().data_ptr() == first
    assert torch.equal(smaller[0], grads[0].float())
    bigger = [torch.ones(1000, dtype=torch.bfloat16)]
    assert torch.equal(widen(bigger, torch.float32)[0], torch.ones(1000))  # grown when needed
