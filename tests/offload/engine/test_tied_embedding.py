"""An embedding's input-side gradient as sparse rows: the same bits as the dense backward."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from outcore.offload.device import supports_sparse
from outcore.offload.engine.tied_embedding import dense_range, row_gradient_embedding


def _sparse_on(device: torch.device) -> None:
    if not supports_sparse(device):
        pytest.skip(f"{device.type} holds no sparse COO tensors (a gap of the simulated accelerator; "
                    "the engine takes autograd's dense embedding gradient there)")


def _tied_grads(embedding: nn.Embedding, head_grad: torch.Tensor, ids: torch.Tensor, g: torch.Tensor):
    """The weight's gradient with a stand-in tied head whose gradient is ``head_grad``."""
    embedding.weight.grad = None
    out = embedding(ids)
    # a stand-in head: its gradient on the shared weight is exactly `head_grad`
    head = (embedding.weight * head_grad).sum()
    torch.autograd.backward([head, out], [torch.ones((), device=g.device), g])
    return embedding.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_the_dense_backward_bit_for_bit(dtype, compute_device):
    """On the compute device: the dense backward there is the reference."""
    _sparse_on(compute_device)
    torch.manual_seed(0)
    embedding = nn.Embedding(500, 48, padding_idx=3).to(dtype)
    ids = torch.randint(0, 40, (4, 300))  # many repeats of each id (16 bits: rounded per add), and the padding id
    ids[0, :10] = 3
    g, head_grad = torch.randn(4, 300, 48, dtype=dtype), torch.randn(500, 48, dtype=dtype)
    embedding, ids, g, head_grad = (x.to(compute_device) for x in (embedding, ids, g, head_grad))
    want = _tied_grads(embedding, head_grad, ids, g).clone()  # autograd merges head + dense rows
    handed = []

    def add_rows(rows):  # what the engine does with them
        assert rows.is_sparse and rows.is_coalesced()
        handed.append(rows)
        embedding.weight.grad.add_(rows)
    restore = row_gradient_embedding(embedding, add_rows)
    got = _tied_grads(embedding, head_grad, ids, g)
    assert len(handed) == 1 and handed[0]._nnz() == len(torch.unique(ids[ids != 3]))
    assert not got.is_sparse and torch.equal(got, want)
    assert torch.equal(got[3], head_grad[3])  # the padding row: the head's part only
    restore()
    assert "forward" not in embedding.__dict__


def test_outputs_unchanged_and_only_plain_trainable_embeddings_change():
    torch.manual_seed(1)
    embedding = nn.Embedding(50, 8)
    ids = torch.randint(0, 50, (2, 5))
    want = embedding(ids)
    restore = row_gradient_embedding(embedding, lambda rows: None)
    assert torch.equal(embedding(ids), want)
    with torch.no_grad():
        assert torch.equal(embedding(ids), want)
    restore()
    for other in (nn.Embedding(50, 8, max_norm=1.0), nn.Embedding(50, 8, sparse=True),
                  nn.Embedding(50, 8).requires_grad_(False)):
        assert row_gradient_embedding(other, lambda rows: None) is None
        assert "forward" not in other.__dict__


def test_dense_range_of_rows_is_the_dense_gradients_slice(compute_device):
    """An untied embedding's sparse row gradient, densified a piece at a time (ranges that cut
    rows, and ranges with no token): each equals the slice of the dense gradient."""
    _sparse_on(compute_device)
    dense = torch.zeros(50, 8, dtype=torch.bfloat16, device=compute_device)
    ids = torch.tensor([2, 3, 17, 40], device=compute_device)
    dense[ids] = torch.randn(4, 8).bfloat16().to(compute_device)
    rows = dense.to_sparse(1).coalesce()
    for lo, hi in ((0, 400), (12, 29), (200, 300), (320, 400)):
        got = dense_range(rows, lo, hi)
        assert got.shape == (hi - lo,) and torch.equal(got, dense.view(-1)[lo:hi])
    assert dense_range(dense, 12, 29).data_ptr() == dense.view(-1)[12:29].data_ptr()  # dense: a view


def test_building_the_rows_warns_nothing():
    """The rows opt out of sparse invariant checks explicitly, so torch says nothing (torch 2.11
    warned once per process despite ``check_invariants=False``: one more line on a run's
    stderr). A fresh process, since torch warns once per process; warnings are errors there."""
    code = ("import warnings, torch; from torch import nn; warnings.simplefilter('error'); "
            "from outcore.offload.engine.tied_embedding import row_gradient_embedding; "
            "e = nn.Embedding(50, 8); got = []; row_gradient_embedding(e, got.append); "
            "e(torch.tensor([[1, 2, 2]])).sum().backward(); "
            "assert len(got) == 1 and got[0].is_sparse and got[0]._nnz() == 2; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert "Warning" not in out.stderr, out.stderr[-2000:]
