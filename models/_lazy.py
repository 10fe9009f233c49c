"""Load a model without ever holding all its weights: built on the meta device,
filled unit by unit from its safetensors files as the out-of-core store takes it.

``load_model`` reads every weight into RAM first, which is what an out-of-core
run must avoid for a model larger than RAM (and what makes the peak RSS of a
small one). ``load_model_lazily`` returns a model whose parameters are on the
meta device and a ``fill(name, out)`` that copies one parameter out of the
memory-mapped safetensors files into the store's buffer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ModelError
from ._check import check_tokenizer, check_weights, load_config, meta_model
from ._gguf_cache import build_gguf_cache
from ._loader import _as_dtype, load_tokenizer, resolve_model_spec


def _weight_files(directory: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file that holds it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / f for name, f in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ModelError(f"'{directory}' has no model.safetensors(.index.json); out-of-core loading "
                         "reads safetensors (save the model with safe_serialization=True)")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


def load_model_lazily(spec: str | Path = "default", *, dtype: torch.dtype | str = torch.float32,
                      cache_dir: str | Path | None = None, tokenizer: bool = True
                      ) -> tuple[torch.nn.Module, Any, Callable[[str, torch.Tensor], None]]:
    """A model on the meta device, its tokenizer, and a reader for its weights.

    Args:
        spec: as :func:`load_model` (local directories and GGUF files; a GGUF is
            dequantized into its safetensors cache first).
        dtype: parameter dtype.
        cache_dir: the GGUF cache location.
        tokenizer: also load the tokenizer (else None in its place; see ``load_model``).

    Returns:
        ``(model, tokenizer, fill)``; ``fill(name, out)`` copies parameter ``name``
        into ``out`` (converting dtype). Non-parameter buffers (rotary tables) are
        real tensors already.

    Raises:
        ModelError: a hub id (download it first), a missing weight, or no safetensors.
    """
    source = resolve_model_spec(spec)
    if source.kind == "hub":
        raise ModelError(f"out-of-core loading needs local files; download '{source.location}' "
                         "first (huggingface-cli download) and pass its directory")
    directory = Path(build_gguf_cache(source.location, cache_dir) if source.kind == "gguf" else source.location)
    dtype = _as_dtype(dtype)
    config = load_config(directory)
    config.use_cache = False
    model = meta_model(directory, config, dtype)
    check_weights(directory, model)  # fill() would find a disagreement only mid-run
    materialize_buffers(model, config)
    files = _weight_files(directory)

    from safetensors import safe_open

    def fill(name: str, out: torch.Tensor) -> None:
        path = files.get(name)
        if path is None:
            raise ModelError(f"weight {name!r} is not in '{directory}'; the files do not match its config.json")
        with safe_open(str(path), "pt") as f:  # memory-mapped: only this tensor's pages are read
            out.copy_(f.get_tensor(name))

    tok = load_tokenizer(spec, cache_dir=cache_dir) if tokenizer else None
    check_tokenizer(model, tok, f"'{spec}'")
    return model, tok, fill


def materialize_buffers(model: torch.nn.Module, config: Any) -> None:
    """Rebuild modules whose buffers are computed, not loaded (rotary tables) on the CPU."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            try:
                fresh = type(module)(config=config)
            except TypeError as err:
                raise ModelError(f"cannot rebuild {name!r} ({type(module).__name__}) off the meta device; "
                                 "use --offload none for this model") from err
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)
