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

import psutil
import torch

from ..errors import ModelError
from ._check import _first_line, check_tokenizer, check_weights
from ._converted import conversion_sources, read_converted
from ._gguf_cache import build_gguf_cache
from ._loader import _as_dtype, load_tokenizer, pretrained_args, resolve_model_spec
from ._structure import check_streamable


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
        ModelError: a hub id (download it first), a model that cannot stream (see
            :func:`check_streamable`), a missing weight, or no safetensors.
    """
    from transformers import AutoConfig

    source = resolve_model_spec(spec)
    if source.kind == "hub":
        raise ModelError(f"out-of-core loading needs local files; download '{source.location}' "
                         "first (huggingface-cli download) and pass its directory")
    dtype = _as_dtype(dtype)
    config = read_model_config(spec, cache_dir)
    model = meta_model(config, dtype)
    # refused here, before any weight is read, in one line naming the part that cannot stream
    check_streamable(model, ram_available=psutil.virtual_memory().available)
    directory = Path(source.location)
    if source.kind == "gguf":  # dequantized once; the cache's own config matches its weight names
        directory = Path(build_gguf_cache(source.location, cache_dir))
        config = AutoConfig.from_pretrained(directory)
        model = meta_model(config, dtype)
    materialize_buffers(model, config)
    if (directory / "generation_config.json").is_file():  # as from_pretrained reads it (eos ids, sampling)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    check_weights(directory, model)  # fill() would find a disagreement only mid-run
    files = _weight_files(directory)

    # parameters stored in another layout (e.g. experts one tensor each, fused in the model)
    converted = conversion_sources(model, list(files))

    from safetensors import safe_open

    def read(key: str) -> torch.Tensor:
        with safe_open(str(files[key]), "pt") as f:  # memory-mapped: only this tensor's pages are read
            return f.get_tensor(key)

    def fill(name: str, out: torch.Tensor) -> None:
        if name in files:
            out.copy_(read(name))
        elif name in converted:
            out.copy_(read_converted(name, converted[name], read, model))
        else:
            raise ModelError(f"weight {name!r} is not in '{directory}'; the files do not match its config.json")

    tok = load_tokenizer(spec, cache_dir=cache_dir) if tokenizer else None
    check_tokenizer(model, tok, f"'{spec}'")
    return model, tok, fill


def read_model_config(spec: str | Path, cache_dir: str | Path | None = None) -> Any:
    """The Hugging Face config of a model spec, without reading any weight.

    Args:
        spec: as :func:`load_model` (a GGUF's config comes from its metadata, or from its
            cache entry when there is one).
        cache_dir: the GGUF cache location.

    Returns:
        The ``PretrainedConfig``.

    Raises:
        ModelError: the spec cannot be resolved, or its config cannot be read.
    """
    from transformers import AutoConfig

    source = resolve_model_spec(spec)
    try:
        location, kwargs = pretrained_args(source, cache_dir)
        return AutoConfig.from_pretrained(location, **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, TypeError, its validators' own
        raise ModelError(f"cannot read the config of '{source.location}': {_first_line(err)}; "
                         "fix its config.json or pass the model's original directory") from None


def meta_model(config: Any, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM of ``config`` built on the meta device (no memory), KV cache off."""
    from transformers import AutoModelForCausalLM

    config.use_cache = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def materialize_buffers(model: torch.nn.Module, config: Any) -> None:
    """Compute on the CPU the buffers that are not loaded but computed (rotary tables, embedding
    scales), as ``from_pretrained`` does: real storage, then the model's own ``_init_weights``.

    The model's init is the one rule that knows every family's buffers (Gemma's
    ``embed_scale``, per-layer-type rotary tables, YaRN frequencies); on the module's
    meta-device parameters it does nothing.

    Raises:
        ModelError: the model has no ``_init_weights`` (not a transformers model).
    """
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise ModelError(f"cannot compute the buffers of {type(model).__name__} ({config.model_type}) off the "
                         "meta device (no _init_weights); use --offload none for this model")
    with torch.no_grad():
        for module in model.modules():
            meta = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
            for name in meta:
                setattr(module, name, torch.empty_like(getattr(module, name), device="cpu"))
            if meta:
                init(module)
