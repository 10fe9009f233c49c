"""Checks that a model directory's parts agree before any weight is read: its config,
its safetensors files and its tokenizer.

Without them a disagreement surfaces late and badly: a layer the config adds is
initialized at random with a warning (``from_pretrained``), a layer it drops is ignored,
integer weights are cast to float, a truncated file raises a ``SafetensorError``
traceback, and a tokenizer with more tokens than the embedding has rows fails with an
``IndexError`` in the first forward. Only the files' headers are read (names, shapes,
dtypes), so the check costs milliseconds whatever the model's size.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelError


def _first_line(err: BaseException) -> str:
    """The first line of an error's message (a library's may run to a page); a line that
    only introduces the next (ends with ':') is joined to it."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]

# safetensors dtype names a trainable checkpoint may hold (anything else — integers,
# booleans, 8-bit floats — is quantized or not weights at all)
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def weight_headers(directory: Path) -> dict[str, tuple[Path, tuple[int, ...], str]] | None:
    """Name -> (file, shape, safetensors dtype) of every tensor in the directory's
    safetensors files; None when it has none (a ``pytorch_model.bin`` only).

    Raises:
        ModelError: a damaged index, a missing shard, or a file that is truncated or not safetensors.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"'{index}' is not a valid safetensors index; restore it from the model's "
                             "original files") from None
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        return None
    headers: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for f in files:
        if not f.is_file():
            raise ModelError(f"shard '{f}' named by '{index}' is missing; download the model again")
        try:
            with safe_open(str(f), "pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    headers[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
        except (SafetensorError, OSError) as err:  # a truncated or foreign file; a directory, unreadable
            raise ModelError(f"weights file '{f}' is truncated or not a safetensors file ({err}); "
                             "download or export the model again") from None
    return headers


def check_weights(directory: Path, model: torch.nn.Module) -> None:
    """Raise unless the directory's safetensors hold exactly ``model``'s parameters, in
    the shapes its config gives them, as floating-point numbers.

    Args:
        directory: the model directory.
        model: the model its config builds (the meta device will do).

    Raises:
        ModelError: a weight missing, unexpected, of another shape or not floating point.
    """
    from ._converted import conversion_sources

    headers = weight_headers(directory)
    if headers is None:
        return
    # stored in another layout (e.g. experts one tensor each): made by the conversion, not checked here
    converted = conversion_sources(model, list(headers))
    sources = {key for _, stored in converted.values() for _, key in stored}
    groups: dict[int, list[str]] = {}  # one parameter (tied ones share it) -> all its names
    shapes: dict[int, tuple[int, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        shapes[id(p)] = tuple(p.shape)
    known = {n for names in groups.values() for n in names}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    for key, names in groups.items():
        if any(n in converted for n in names):
            continue
        present = [n for n in names if n in headers]
        if not present:
            raise ModelError(f"weight {names[0]!r} is missing from '{directory}': its config.json describes "
                             "more than its files hold; use the config the weights were saved with")
        for n in present:
            f, shape, dtype = headers[n]
            if shape != shapes[key]:
                raise ModelError(f"weight {n!r} in '{f}' has shape {list(shape)} but config.json makes it "
                                 f"{list(shapes[key])}; use the config the weights were saved with")
            if dtype not in _FLOAT_DTYPES:
                raise ModelError(f"weight {n!r} in '{f}' is stored as {dtype}, not floating point; "
                                 "pass a float16, bfloat16 or float32 checkpoint")
    for n in headers:
        if n not in known and n not in sources and not n.endswith("inv_freq") and not any(p.search(n) for p in ignored):
            raise ModelError(f"'{headers[n][0]}' holds weight {n!r} that config.json has no place for; "
                             "use the config the weights were saved with")


def check_model_dir(directory: Path) -> None:
    """:func:`check_weights` against the model the directory's own config builds (on meta).

    Raises:
        ModelError: an unreadable config.json, or see :func:`check_weights`.
    """
    from ._lazy import meta_model, read_model_config  # (which imports this module)

    check_weights(directory, meta_model(read_model_config(str(directory))))


def check_tokenizer(model: torch.nn.Module, tokenizer: Any, where: str) -> None:
    """Raise when the tokenizer makes ids the model's embedding has no row for.

    Raises:
        ModelError: ``len(tokenizer)`` exceeds the embedding's rows.
    """
    if tokenizer is None:
        return
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelError(f"the tokenizer of {where} has {len(tokenizer)} tokens but the model's embedding "
                         f"has {rows} rows; use the tokenizer the model was trained with")
