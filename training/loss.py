"""The held-out loss of a run: the token-weighted mean over the validation batches."""
from __future__ import annotations

from typing import Any, Callable

import torch


@torch.no_grad()
def evaluate(loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], dataset: Any,
             batch_size: int, n_batches: int) -> float:
    """Token-weighted mean loss over the fixed validation batches.

    Args:
        loss_fn: batch -> mean loss over its labelled tokens.
        n_batches: how many batches of the validation set (0 = all of it).

    Returns:
        The mean loss (a float: this is a host sync, once per evaluation).
    """
    from ..data import eval_batches

    total, tokens = 0.0, 0
    for batch in eval_batches(dataset, batch_size, n_batches):
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(loss_fn(batch)) * n
        tokens += n
    return total / max(tokens, 1)
