"""Plain text → token ids → fixed-length packed sequences, with an on-disk token cache.

Documents are tokenized in batches by the fast (Rust) tokenizer, an EOS token is
appended after each document, and the concatenated ids are cut into
``seq_len``-token rows (the tail that does not fill a row is dropped): the
standard packing of GPT-style pre-training, where every position carries loss.
With ``padding_free`` (TRL's name) a row also carries position ids that restart after each
EOS (:func:`document_positions`), so the model keeps its documents apart.

Tokenizing the 5 MB default corpus costs ~4 s on 2 cores; reading the cached
ids costs milliseconds, so ids are cached under ``<cache_dir>/tokens/`` keyed by
the files (path, size, mtime), ``max_bytes`` and a fingerprint of the tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from .._atomic import write_atomic
from ..errors import DataError
from ._sources import read_text_files

log = logging.getLogger(__name__)

TOKEN_CACHE_FORMAT = 1
_BATCH_CHARS = 8 << 20  # tokenize at most ~8 MB of text per batch: bounds the Python-int lists


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash that changes whenever the tokenizer would produce other ids.

    Args:
        tokenizer: a Hugging Face tokenizer (fast ones hash their full JSON definition).

    Returns:
        16 hex characters.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # slow tokenizer: the vocabulary is the best stable description we have
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([len(tokenizer), tokenizer.eos_token_id, type(tokenizer).__name__])
    return hashlib.sha256((definition + extra).encode("utf-8")).hexdigest()[:16]


def tokenize_documents(tokenizer, docs: list[str]) -> torch.Tensor:
    """Tokenize documents and join them, an EOS token after each.

    Args:
        tokenizer: a Hugging Face tokenizer (fast is much faster: batched in Rust).
        docs: the documents; blank ones are skipped.

    Returns:
        ``[n_tokens]`` int32 ids.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        log.warning("tokenizer has no EOS token: documents are joined without a separator")
    docs = [d for d in docs if d.strip()]
    pieces: list[np.ndarray] = []
    start = 0
    while start < len(docs):
        stop, chars = start, 0
        while stop < len(docs) and (stop == start or chars + len(docs[stop]) <= _BATCH_CHARS):
            chars += len(docs[stop])
            stop += 1
        encoded = tokenizer(docs[start:stop], add_special_tokens=False)["input_ids"]
        for ids in encoded:
            pieces.append(np.asarray(ids, dtype=np.int32))
            if eos is not None:
                pieces.append(np.asarray([eos], dtype=np.int32))
        start = stop
    if not pieces:
        return torch.empty(0, dtype=torch.int32)
    return torch.from_numpy(np.concatenate(pieces))


def _cache_key(files, max_bytes: int, tokenizer) -> str:
    stats = []
    for path in files:
        st = Path(path).stat()
        stats.append([str(Path(path).resolve()), st.st_size, st.st_mtime_ns])
    payload = {"files": stats, "max_bytes": max_bytes, "format": TOKEN_CACHE_FORMAT,
               "tokenizer": tokenizer_fingerprint(tokenizer)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _save_atomic(path: Path, ids: torch.Tensor) -> None:
    """Write ``ids`` to ``path`` as ``.npy``, whole or not at all."""
    write_atomic(path, lambda f: np.save(f, ids.numpy()), suffix=".npy")


def load_text_tokens(files, tokenizer, *, max_bytes: int = 0,
                     cache_dir: Path | None = None) -> torch.Tensor:
    """Token ids of text files, from the cache when it holds them.

    Args:
        files: the text files, in order.
        tokenizer: the tokenizer.
        max_bytes: read at most this many bytes (0 = all).
        cache_dir: cache root (ids go to ``cache_dir/tokens``); None disables the cache.

    Returns:
        ``[n_tokens]`` int32 ids (EOS after each document).

    Raises:
        DataError: a file cannot be read or is not UTF-8.
    """
    cached: Path | None = None
    if cache_dir is not None:
        cached = Path(cache_dir) / "tokens" / f"{_cache_key(files, max_bytes, tokenizer)}.npy"
        if cached.is_file():
            try:
                return torch.from_numpy(np.load(cached))
            except (OSError, ValueError) as err:  # damaged entry: rebuild it
                log.warning("ignoring unreadable token cache %s: %s", cached, err)
    ids = tokenize_documents(tokenizer, read_text_files(files, max_bytes))
    if cached is not None:
        try:
            _save_atomic(cached, ids)
        except OSError as err:  # a cache is an optimization: never fail the run for it
            log.warning("cannot write token cache %s: %s", cached, err)
    return ids


def pack_sequences(ids: torch.Tensor, seq_len: int, *, label: str) -> torch.Tensor:
    """Cut a flat id stream into full ``seq_len`` rows (the short tail is dropped).

    Args:
        ids: ``[n_tokens]`` token ids.
        seq_len: tokens per row.
        label: the data spec, for the error message.

    Returns:
        ``[n_rows, seq_len]`` view of ``ids`` (no copy).

    Raises:
        DataError: fewer than ``seq_len`` tokens.
    """
    rows = ids.numel() // seq_len
    if rows == 0:
        if ids.numel() == 0:
            raise DataError(f"data '{label}' holds no text; add text to it")
        raise DataError(f"data '{label}' has {ids.numel()} tokens, shorter than one sequence of "
                        f"seq_len={seq_len}; add text or lower seq_len")
    return ids[: rows * seq_len].view(rows, seq_len)


def document_positions(rows: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids of packed rows that restart at each document: at the row's start and
    after every ``eos_id`` (a document's last token), as TRL's padding-free collator gives them.

    Args:
        rows: ``[N, T]`` token ids, documents joined with ``eos_id`` after each.
        eos_id: the token that ends a document.

    Returns:
        ``[N, T]`` int32: ``0, 1, …`` within each document.
    """
    n, t = rows.shape
    index = torch.arange(t, dtype=torch.int32).expand(n, t)
    starts = torch.zeros((n, t), dtype=torch.bool)
    starts[:, 1:] = rows[:, :-1] == eos_id
    # each position minus the index of the latest document start at or before it
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return (index - first).contiguous()
