"""Units of transfer: a model cut into the pieces that move between tiers together.

A causal LM becomes ``[embed, block 0, ..., block L-1, head]``. Each unit owns
its parameters laid out back to back in one *flat* buffer per tensor class
(weights, each optimizer-state tensor, gradients), so one unit moves as one
extent with one I/O request. Offsets are padded to 64 bytes: the views handed to
compute kernels keep the alignment torch's allocator would give them, so
out-of-core matmuls take the same code paths — and give the same bits — as
in-memory ones.

A weight shared by two units (tied input embedding and LM head) is owned by the
first unit that uses it; later units list its owner in ``borrows``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ModelError

_ALIGN_BYTES = 64


@dataclass
class ParamSlot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str  # qualified name in the model
    param: nn.Parameter
    offset: int  # in elements of the flat buffer
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class Unit:
    """A group of modules whose parameters move together."""

    index: int
    name: str
    modules: list[nn.Module]
    slots: list[ParamSlot] = field(default_factory=list)  # parameters this unit owns
    numel: int = 0  # elements of the flat buffer (with alignment padding)
    borrows: list[int] = field(default_factory=list)  # units whose weights this one also needs

    def view(self, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """The parameter ``slot`` as a view into ``flat`` [numel] (no copy)."""
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)


def _pad(n: int, itemsize: int) -> int:
    per = max(1, _ALIGN_BYTES // itemsize)
    return (n + per - 1) // per * per


def causal_lm_units(model: nn.Module, resident_trainable: bool = False,
                    head_modules: list[nn.Module] | tuple[nn.Module, ...] = ()) -> list[Unit]:
    """Cut a Hugging Face causal LM into ``[embed, blocks..., head]`` units.

    Args:
        model: a Llama / Qwen2 / Mistral / Gemma3-style ``*ForCausalLM`` (or a peft
            wrapper of one).
        resident_trainable: lay out only the frozen parameters; those that train
            stay where they are, resident (LoRA: the base streams, the adapters stay).
        head_modules: modules that compute with the head after ``lm_head`` (or instead
            of calling it, like a chunked loss holding ``lm_head``); the head unit ends
            when the last of them returns.

    Returns:
        The units in forward order; every parameter of the model is owned by
        exactly one unit.

    Raises:
        ModelError: the model has no recognizable embed / blocks / head.
    """
    from ..models import model_parts

    parts = model_parts(model)
    groups: list[tuple[str, list[nn.Module]]] = [("embed", [parts.embed])]
    groups += [(f"block.{i}", [layer]) for i, layer in enumerate(parts.layers)]
    head = [m for m in (parts.final_norm, parts.lm_head, *head_modules) if m is not None]
    groups.append(("head", head))

    names = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, int] = {}
    units: list[Unit] = []
    for index, (name, modules) in enumerate(groups):
        unit = Unit(index=index, name=name, modules=modules)
        offset = 0
        for module in modules:
            for p in module.parameters():
                if id(p) in owner:
                    if owner[id(p)] != index and owner[id(p)] not in unit.borrows:
                        unit.borrows.append(owner[id(p)])
                    continue
                owner[id(p)] = index
                if resident_trainable and p.requires_grad:
                    continue
                unit.slots.append(ParamSlot(names[id(p)], p, offset, p.shape))
                offset += _pad(p.numel(), p.element_size())
        unit.numel = offset
        units.append(unit)

    missing = [n for n, p in model.named_parameters() if id(p) not in owner]
    if missing:
        raise ModelError(f"parameter {missing[0]!r} belongs to no embed/block/head unit; "
                         "outcore's out-of-core mode supports Llama/Qwen2/Mistral/Gemma3-style models")
    return units
