"""LoRA adapters through peft, initialized the same way whether the base is in RAM or on the meta device."""
from __future__ import annotations

from typing import Sequence

import torch


def add_lora(model: torch.nn.Module, *, r: int, alpha: float, dropout: float, targets: Sequence[str],
             seed: int) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters on the ``targets`` modules; the base is frozen.

    The adapters are (re)initialized here from ``seed``, in module order. A model built
    on the meta device (out of core) gets its adapters on the meta device from peft;
    they are made real here first. So an in-memory and an out-of-core run of the same
    config start from the same adapters, bit for bit.

    Args:
        model: a causal LM (in memory or on the meta device).
        r, alpha, dropout: LoRA rank, scale numerator and dropout.
        targets: module names to adapt (``q_proj`` …).
        seed: seeds the adapters' initialization.

    Returns:
        The ``PeftModel``.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    torch.manual_seed(seed)
    for layer in model.modules():
        if hasattr(layer, "reset_lora_parameters") and hasattr(layer, "lora_A"):
            for adapter in layer.lora_A:
                for part in (layer.lora_A[adapter], layer.lora_B[adapter]):
                    if any(p.is_meta for p in part.parameters()):
                        part.to_empty(device="cpu")
                layer.reset_lora_parameters(adapter, init_lora_weights=True)
    return model


def lora_deltas(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The merged LoRA update of every adapted weight under ``module``, in fp32.

    Returns:
        ``id(base weight)`` -> the sum of its active adapters' ``get_delta_weight``
        (the weight's shape, scaling included); empty for a module without adapters.
    """
    deltas: dict[int, torch.Tensor] = {}
    for layer in module.modules():
        if not (hasattr(layer, "get_delta_weight") and hasattr(layer, "get_base_layer")):
            continue
        key = id(layer.get_base_layer().weight)
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "lora_A", {}):
                with torch.no_grad():
                    d = layer.get_delta_weight(adapter).float()
                deltas[key] = deltas[key] + d if key in deltas else d
    return deltas


def plain_name(name: str) -> str:
    """A parameter's name in the plain model, from its name under a peft wrapper."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
