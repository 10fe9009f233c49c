"""Forward-only streaming: a model's weights read through the tiers for inference (generation).

The training engine serves as it is (docs/architecture.md §11): its module hooks bind each
unit before it computes and let it go after, prefetching the next *k* units; under
``torch.no_grad`` no backward is registered, so a forward is just that walk
``embed, block 0 … block L-1, head``. What inference adds is the turn between two
forwards: each generated token is one more forward, which starts again at the embedding,
so the first *k* units are prefetched as the head finishes (while the sampler and the
caller's streamer run), as ``train_step`` does at the start of a step.

The KV cache of transformers' ``generate`` needs nothing from the engine: its keys and
values are new tensors computed from the weights, never views of them. Every generated
token still costs one pass of all the weights through the tiers.
"""
from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

import torch

from ...events import TierStats
from .engine import OutOfCoreEngine
from .assemble import offload_model


class StreamedInference:
    """A causal LM whose weights live in the tiers and stream in for each forward.

    Args:
        model: the model (its parameters are frozen and laid out into the store; on the
            meta device, ``init_weights`` fills them unit by unit).
        offload: ``cpu`` (weights in HOST RAM) or ``nvme`` (in ``swap_dir``).
        swap_dir: the swap directory (created 0700, locked, removed on :meth:`close`).
        prefetch: units fetched ahead of the one computing (k).
        init_weights: fills a parameter ``(slot, tensor)`` of a meta-device model as its
            unit is stored (see ``models.load_model_lazily``).
        head_modules: modules computed after the LM head that are part of its unit (a
            loss head that uses its weight: ``CausalLMHeadLoss``).
        device_bytes, host_bytes: DEVICE / HOST arena budgets (None: what the engine needs).
        device: where it computes (``auto``: the GPU when there is one).
        quantize_frozen: store the blocks' matrices in NF4 and dequantize each unit as it is
            fetched (QLoRA's base; see ``nf4.py``): 0.56 B per weight read per token instead of 2.

    Raises:
        ConfigError: an unknown ``offload``, or ``nvme`` without a swap dir.
        SwapDirError: the swap dir cannot be used.
    """

    def __init__(self, model: torch.nn.Module, *, offload: str, swap_dir: str | Path | None, prefetch: int = 2,
                 init_weights: Callable[[Any, torch.Tensor], None] | None = None,
                 head_modules: Sequence[torch.nn.Module] = (), device_bytes: int | None = None,
                 host_bytes: int | None = None, device: str | torch.device | None = "auto",
                 quantize_frozen: bool = False):
        for p in model.parameters():
            p.requires_grad_(False)  # no gradient, so no optimizer state and no write-back
        self.engine: OutOfCoreEngine = offload_model(model, None, offload=offload, swap_dir=swap_dir,
                                                     prefetch=prefetch, init_weights=init_weights,
                                                     head_modules=tuple(head_modules), device_bytes=device_bytes,
                                                     host_bytes=host_bytes, master_weights=False, device=device,
                                                     quantize_frozen=quantize_frozen)
        head = self.engine.units[-1].modules[-1]
        # The first forward starts cold; each later one is fetched while the previous token is sampled.
        self._hooks = [model.register_forward_pre_hook(lambda m, a: self.engine.prefetch_first()),
                       head.register_forward_hook(lambda m, a, out: self.engine.prefetch_first())]

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for a weight read, since the start."""
        return self.engine.stall_s

    def tier_stats(self) -> dict[str, TierStats]:
        """Per-tier occupancy and traffic since the previous call."""
        return self.engine.tier_stats()

    def close(self) -> None:
        """Take the hooks off, free the arenas and remove the swap directory."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.engine.close()
