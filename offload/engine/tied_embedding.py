"""An embedding's input-side gradient as sparse rows, not autograd's dense [V, H] tensor.

Autograd's embedding backward makes a dense [V, H] gradient — zeros but for the rows of
the batch's tokens: 1 GiB in bf16 for Llama-3's 128256 x 4096 embedding, though a step of
256 tokens touches 256 rows; and for an embedding tied to the LM head it adds that to the
head's [V, H] gradient into a third [V, H] tensor (autograd merges the two out of place).
Here the input side computes with a separate leaf that aliases the weight, so the head's
gradient (if tied) lands in ``weight.grad`` alone; the backward sums the input side's
gradient rows per token id with torch's own dense embedding backward over the batch's
distinct ids (same kernel, same order per row: the same bits) and hands them to ``on_rows``
as a coalesced sparse tensor. The engine adds them into a tied head's gradient in place
(``head + rows`` is the same bits as autograd's ``head + dense``), or keeps them as the
untied embedding's gradient, densified one piece at a time by the update
(:func:`dense_range`). Tested bit for bit against the dense backward.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class _RowGradEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient is sparse rows."""

    @staticmethod
    def forward(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ids, weight, padding_idx = inputs
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.padding_idx = weight.shape, padding_idx

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        uniq, inverse = torch.unique(flat, return_inverse=True)
        # the dense backward itself over the distinct ids: its arithmetic, row for row (in 16
        # bits index_add_ rounds differently where an id repeats 3+ times)
        sums = torch.ops.aten.embedding_dense_backward(rows, inverse, len(uniq), -1, False)
        return None, _coalesced_rows(uniq.unsqueeze(0), sums, ctx.weight_shape), None


def _coalesced_rows(indices: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A sparse COO tensor of rows whose ids are sorted and unique (from ``torch.unique``), so
    it is built coalesced and unchecked (a check would be one more pass over the ids).

    ``check_invariants=False`` alone is not enough on torch 2.11: it still warns once per
    process ("Sparse invariant checks are implicitly disabled", an extra stderr line in every
    run); torch 2.13 takes the argument as the explicit opt-out it is. Both honour the opt-out
    the warning asks for, ``check_sparse_tensor_invariants(enable=False)``, which restores the
    previous setting on exit.
    """
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        return torch.sparse_coo_tensor(indices, values, shape, is_coalesced=True, check_invariants=False)


def row_gradient_embedding(embedding: nn.Module, on_rows: Callable[[torch.Tensor], None]
                           ) -> Callable[[], None] | None:
    """Make ``embedding``'s input-side gradient arrive as sparse rows, handed to ``on_rows``.

    Only for a plain floating-point ``nn.Embedding`` that trains (no ``max_norm``, no
    ``scale_grad_by_freq``, not already sparse); the instance's ``forward`` is replaced
    (hooks still run), the model's code is not touched. The weight's own gradient then
    holds only what other uses (a tied head) give it; ``on_rows(rows)`` — called once per
    backward, after the input side's gradient is complete — must add ``rows`` to it.

    Returns:
        A function that puts the original ``forward`` back, or None when ``embedding``
        is not eligible (nothing was changed).
    """
    eligible = (type(embedding) is nn.Embedding and embedding.weight.requires_grad
                and embedding.weight.is_floating_point() and embedding.max_norm is None
                and not embedding.scale_grad_by_freq and not embedding.sparse)
    if not eligible:
        return None

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.embedding(ids, embedding.weight, embedding.padding_idx)
        # a leaf of its own over the same storage: its gradient never meets the head's
        leaf = embedding.weight.detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(lambda t: on_rows(_take(t)))
        return _RowGradEmbedding.apply(ids, leaf, embedding.padding_idx)

    embedding.forward = forward

    def restore() -> None:
        if embedding.__dict__.get("forward") is forward:
            del embedding.forward
    return restore


def _take(leaf: torch.Tensor) -> torch.Tensor:
    """The leaf's gradient, handed over (the leaf lets go of it). Autograd stores a sparse
    gradient without its coalesced flag; its ids are unique and sorted (``torch.unique``),
    so the flag is put back and adding it needs no re-sort."""
    rows, leaf.grad = leaf.grad, None
    return _coalesced_rows(rows._indices(), rows._values(), rows.shape)


def dense_range(grad: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of ``grad`` flattened, dense: a dense gradient's slice, or a sparse
    row gradient's (from ``on_rows``) densified over only the rows the range covers — zeros
    where no token was, as autograd's dense backward has them.

    Args:
        grad: a [V, H] gradient, dense or sparse (coalesced rows).
        lo, hi: the element range, in the flattened [V * H].

    Returns:
        A dense 1-D tensor of ``hi - lo`` elements (a view when ``grad`` is dense).
    """
    if not grad.is_sparse:
        return grad.reshape(-1)[lo:hi]
    width = grad.shape[1]
    first, end = lo // width, -(-hi // width)
    ids, values = grad._indices()[0], grad._values()
    inside = (ids >= first) & (ids < end)
    rows = values.new_zeros(end - first, width)
    rows[ids[inside] - first] = values[inside]
    return rows.view(-1)[lo - first * width:hi - first * width]
