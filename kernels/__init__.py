"""outcore.kernels: fused ops, each a ``torch.library`` op with a pure-PyTorch reference.

- ``causal_lm_loss`` / ``linear_cross_entropy`` / ``CausalLMHeadLoss``: the LM loss without
  [tokens, vocab] logits (Triton chunk kernel on CUDA).
- ``quantize_blockwise`` / ``dequantize_blockwise``: 8-bit dynamic block quantization.
- ``adamw8bit_update``: the fused 8-bit AdamW step (C++ on CPU, Triton on CUDA).
- ``zo_perturb_``: a zeroth-order perturbation regenerated from a seed.

Imported lazily: nothing here compiles or touches CUDA/Triton at import time.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "causal_lm_loss": "linear_cross_entropy", "linear_cross_entropy": "linear_cross_entropy",
    "CausalLMHeadLoss": "linear_cross_entropy", "quantize_blockwise": "quantize",
    "dequantize_blockwise": "quantize", "adamw8bit_update": "adamw8bit", "zo_perturb_": "zo_perturb",
}
__all__ = list(sorted(_EXPORTS))


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
