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


def merge_lora(model: torch.nn.Module, name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with the active LoRA adapters of ``model``'s parameter ``name`` merged in.

    The one LoRA merge of every export (in memory, out of core, QLoRA): the adapters'
    ``get_delta_weight`` summed in fp32 and added in fp32, rounded once to ``weight``'s
    dtype (a QLoRA base comes dequantized to fp32, so its update is never rounded to NF4).
    Computed per weight on demand, so an out-of-core export holds one unit's deltas at a time.

    Args:
        model: the peft model whose ``named_parameters`` gave ``name``.
        name: the parameter's qualified name, e.g. ``base_model.model.….q_proj.base_layer.weight``.
        weight: that parameter's value (a copy out of a store, or dequantized from NF4).

    Returns:
        The merged weight, or ``weight`` itself when ``name`` has no adapter.
    """
    layer_name, sep, rest = name.rpartition(".base_layer.")
    if not sep or rest != "weight":  # not an adapted weight (biases of adapted layers included)
        return weight
    layer = model.get_submodule(layer_name)
    delta = None
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_A", {}):
            with torch.no_grad():
                d = layer.get_delta_weight(adapter).float()
            delta = d if delta is None else delta + d
    if delta is None:
        return weight
    # out of core the weight is a CPU copy out of the store while resident adapters compute on the
    # device: the delta joins the weight (an fp32 add, the same bits on either)
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def is_adapter(name: str) -> bool:
    """Is the parameter ``name`` a LoRA adapter's own (``lora_A`` / ``lora_B`` …), not a base weight?"""
    return ".lora_" in name


def plain_name(name: str) -> str:
    """A parameter's name in the plain model, from its name under a peft wrapper."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The plain causal LM under a peft wrapper (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
