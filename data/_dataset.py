"""Fixed-length token datasets and ``build_datasets``: spec → (train, val).

A :class:`SequenceDataset` is a view on ``[N, seq_len]`` tensors (ids, labels,
attention mask) through an index of rows, so the train and validation splits
share one storage and never copy it. The split is a seeded permutation of the
rows: the same seed always holds out the same rows, and no row is in both.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ConfigError, DataError
from ._chat import encode_rows, pad_examples
from ._sources import iter_jsonl, resolve_data_spec
from ._text import document_positions, load_text_tokens, pack_sequences

log = logging.getLogger(__name__)


class SequenceDataset(torch.utils.data.Dataset):
    """Rows of ``seq_len`` tokens: ``input_ids``, ``labels`` (-100 = no loss), and
    ``attention_mask`` or, for rows packed with document boundaries, ``position_ids``.

    Args:
        input_ids: ``[N, seq_len]`` integer ids (int32 storage is fine: batches are int64).
        labels: ``[N, seq_len]`` targets, or None when they equal ``input_ids`` (packed text).
        attention_mask: ``[N, seq_len]`` 1/0, or None when every position is real.
        index: which rows this dataset exposes (``[len]`` int64), None for all of them.
        kind: ``"text"``, ``"instruction"``, ``"chat"`` or ``"mixed"`` (for logs).
        position_ids: ``[N, seq_len]``, restarting at each document of a packed row
            (:func:`~._text.document_positions`), or None.
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, index: torch.Tensor | None = None,
                 kind: str = "text", position_ids: torch.Tensor | None = None) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [N, seq_len], got shape {tuple(input_ids.shape)}")
        if position_ids is not None and attention_mask is not None:
            raise ValueError("position_ids mark a packed row's documents, which has no padding: "
                             "give no attention_mask with them")
        for name, t in (("labels", labels), ("attention_mask", attention_mask), ("position_ids", position_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(input_ids.shape)}")
        self._ids = input_ids
        self._labels = labels
        self._mask = attention_mask
        self._positions = position_ids
        self.index = (torch.arange(input_ids.shape[0]) if index is None
                      else torch.as_tensor(index, dtype=torch.long))
        self.kind = kind

    @property
    def seq_len(self) -> int:
        """Tokens per row."""
        return int(self._ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in this dataset."""
        if self._mask is None:
            return len(self) * self.seq_len
        return int(self._mask[self.index].sum())

    def __len__(self) -> int:
        return int(self.index.numel())

    def subset(self, index: torch.Tensor) -> "SequenceDataset":
        """A dataset of rows ``self.index[index]``, sharing this one's storage."""
        return SequenceDataset(self._ids, self._labels, self._mask, self.index[index], self.kind, self._positions)

    def get_batch(self, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows ``indices`` (positions in this dataset) as ``[B, seq_len]`` int64 tensors.

        Args:
            indices: positions ``0 <= i < len(self)``.

        Returns:
            ``{"input_ids", "labels", "attention_mask"}``, each ``[B, seq_len]`` int64; packed
            with document boundaries, ``position_ids`` instead of the mask (TRL's padding-free
            batch: a mask would hide the documents from transformers) and no label at a
            document's first token, which the one before cannot predict.
        """
        pos = torch.as_tensor(indices, dtype=torch.long)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= len(self)):
            raise IndexError(f"indices out of range for a dataset of {len(self)} rows")
        rows = self.index[pos]
        ids = self._ids[rows].long()
        labels = ids.clone() if self._labels is None else self._labels[rows].long()
        if self._positions is not None:
            positions = self._positions[rows].long()
            labels[positions == 0] = -100
            return {"input_ids": ids, "labels": labels, "position_ids": positions}
        mask = torch.ones_like(ids) if self._mask is None else self._mask[rows].long()
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not isinstance(i, int):
            i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for a dataset of {len(self)} rows")
        return {k: v[0] for k, v in self.get_batch([i]).items()}


def split_rows(n: int, val_fraction: float, seed: int, *, label: str, seq_len: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hold out a seeded random ``val_fraction`` of ``n`` rows.

    Args:
        n: number of rows.
        val_fraction: share held out; 0 keeps every row for training (empty validation).
        seed: the split depends on it only.
        label, seq_len: for messages.

    Returns:
        ``(train_rows, val_rows)``: disjoint, sorted int64 tensors covering ``0..n-1``.

    Raises:
        DataError: too few rows to hold out at least one for validation and keep one.
    """
    n_val = 0 if val_fraction == 0 else max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise DataError(f"data '{label}' gives only {n} sequence(s) of seq_len={seq_len}: too few "
                        f"to hold out a validation split; add data, lower seq_len, or set "
                        f"val_fraction=0")
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=generator)
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def _check_args(seq_len: int, val_fraction: float, max_bytes: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"seq_len={seq_len!r} must be an integer >= 2 (tokens per sequence)")
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction!r} must be in [0, 1); 0.02 holds out 2%")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ConfigError(f"max_bytes={max_bytes!r} must be an integer >= 0 (0 reads all)")


def _pad_id(tokenizer) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def _document_end(tokenizer) -> int:
    """The token that ends a document in packed text (:func:`~._text.tokenize_documents`)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError("padding_free=true finds documents by their EOS token, and this tokenizer has none; "
                          "set padding_free=false")
    return int(tokenizer.eos_token_id)


def build_datasets(spec: str | Path, tokenizer, seq_len: int, *, seed: int = 0,
                   val_fraction: float = 0.02, max_bytes: int = 0,
                   cache_dir: str | Path | None = None, use_cache: bool = True,
                   padding_free: bool = False) -> tuple[SequenceDataset, SequenceDataset]:
    """Load, tokenize and split training data.

    Args:
        spec: ``"default"`` (the Shakespeare corpus), a text file or folder, or a
            ``.jsonl`` file/folder of instruction or chat rows.
        tokenizer: the model's tokenizer.
        seq_len: tokens per row. Text is packed into full rows; JSONL rows are
            truncated/padded (pad id = pad or EOS, label -100, attention mask 0).
        seed: seeds the validation split.
        val_fraction: share of rows held out (at least one row when > 0).
        max_bytes: read at most this many bytes of data (0 = all).
        cache_dir: cache root for tokenized text (default ``$OUTCORE_CACHE`` or
            ``~/.cache/outcore``).
        use_cache: False never reads or writes the token cache.
        padding_free: packed text keeps its document boundaries (TRL's name): each row's
            position ids restart after every EOS, and a document's first token has no label.

    Returns:
        ``(train, val)`` :class:`SequenceDataset` s over disjoint rows.

    Raises:
        DataError: missing/unreadable/malformed data (JSONL errors name ``file:line``),
            or too little data for one training row plus the validation split.
        ConfigError: ``seq_len``, ``val_fraction`` or ``max_bytes`` out of range, or
            ``padding_free`` for JSONL rows or a tokenizer without an EOS token.
    """
    _check_args(seq_len, val_fraction, max_bytes)
    source = resolve_data_spec(spec)
    if source.kind == "text":
        root = None
        if use_cache:
            from ..models import default_cache_dir
            root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        ids = load_text_tokens(source.files, tokenizer, max_bytes=max_bytes, cache_dir=root)
        rows = pack_sequences(ids, seq_len, label=source.label)
        positions = document_positions(rows, _document_end(tokenizer)) if padding_free else None
        full = SequenceDataset(rows, kind="text", position_ids=positions)
    elif padding_free:
        raise ConfigError(f"padding_free=true keeps the document boundaries of packed text; '{source.label}' "
                          f"is JSONL, one example a row, not packed: set padding_free=false")
    else:
        examples, kind = encode_rows(tokenizer, iter_jsonl(source.files, max_bytes))
        if not examples:
            raise DataError(f"data '{source.label}' has no rows; add JSONL rows with "
                            f"instruction/output or messages")
        ids, labels, mask, dropped = pad_examples(examples, seq_len, _pad_id(tokenizer))
        if dropped == len(examples):
            raise DataError(f"no row of '{source.label}' keeps an answer token within "
                            f"seq_len={seq_len} (all {dropped} are prompt only after truncation); "
                            f"raise seq_len or shorten the prompts")
        if dropped:
            log.warning("dropped %d of %d rows of %s: their answer starts beyond seq_len=%d",
                        dropped, len(examples), source.label, seq_len)
        full = SequenceDataset(ids, labels, mask, kind=kind)
    train_rows, val_rows = split_rows(len(full), val_fraction, seed, label=source.label,
                                      seq_len=seq_len)
    return full.subset(train_rows), full.subset(val_rows)
