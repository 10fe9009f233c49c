"""Read one parameter of a model whose checkpoint stores it in another layout.

transformers keeps some families' weights in the model in another layout than in
their checkpoints: Mixtral's and Qwen3-MoE's experts are stored one tensor per
expert (``experts.0.w1.weight`` ...) but live fused in the model
(``experts.gate_up_proj``). ``from_pretrained`` converts them while loading the
whole model, with the conversion mapping transformers registers per family. The
out-of-core loader reads one parameter at a time, so it applies the same mapping
(transformers' own renamings and converters, never a copy of them) to the stored
tensors of that one parameter only.
"""
from __future__ import annotations

from copy import deepcopy
from typing import Any, Callable

import torch

#: (converter or None, [(source pattern, stored key), ...]) for one model parameter
Sources = tuple[Any, list[tuple[str, str]]]


def conversion_sources(model: torch.nn.Module, stored_keys: list[str]) -> dict[str, Sources]:
    """Which stored tensors make each parameter, by transformers' conversion mapping.

    Args:
        model: the (meta-device) transformers model.
        stored_keys: every tensor name in its checkpoint.

    Returns:
        Parameter name -> its :data:`Sources`; only the parameters whose stored name
        differs from their own (renamed or converted) are listed.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    own = model.state_dict()
    sources: dict[str, Sources] = {}
    for key in sorted(stored_keys, key=dot_natural_key):  # experts in order, as from_pretrained
        if key in own:
            continue
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, own)
        if target in own:
            entry = sources.setdefault(target, (by_pattern.get(pattern), []))
            entry[1].append((pattern, key))
    return sources


def read_converted(name: str, sources: Sources, read: Callable[[str], torch.Tensor],
                   model: torch.nn.Module) -> torch.Tensor:
    """Parameter ``name`` built from its stored tensors (``read(key)`` reads one).

    Args:
        name: the model's parameter name.
        sources: its entry of :func:`conversion_sources`.
        read: reads one stored tensor by name.
        model: the model (the conversion ops may read its config).

    Returns:
        The tensor in the model's layout.
    """
    converter, keys = sources
    if converter is None:  # a plain renaming
        return read(keys[0][1])
    converter = deepcopy(converter)  # it collects tensors: one copy per parameter, as from_pretrained
    for pattern, key in keys:
        converter.add_tensor(name, key, pattern, lambda key=key: read(key))
    return converter.convert(name, model=model, config=model.config)[name]
