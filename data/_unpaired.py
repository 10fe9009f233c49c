"""Unpaired preference data (TRL's KTO format) → a completion row and a mismatched ``KL`` row
per example, with loss only on the completions.

A JSONL row is ``{"prompt", "completion", "label"}``: ``prompt`` and ``completion`` each a
string (plain text) or a list of ``{"role", "content"}`` messages (conversational), ``label``
true (a desirable completion) or false. A file of paired rows (``prompt`` / ``chosen`` /
``rejected``, see :mod:`._preference`) is unpaired as TRL's ``unpair_preference_dataset``
does: per 1000 pairs, their chosen completions (true) then their rejected ones (false).

Tokenized as TRL's ``KTOTrainer`` does (the completion starts where ``prompt`` and ``prompt +
completion`` first differ; plain text gets EOS). KTO's KL term is estimated from mismatched
pairs: as TRL does, within each run of ``batch_size`` consecutive examples every prompt gets
the completion of the example before it (the first gets the last's). The rows are fixed here,
once, after the train/validation split, and the loader then visits the examples in order
(TRL's sequential sampler), so a batch's KL rows are its own completions rotated by one: the
same batches in memory, out of core and on resume.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import DataError
from ._chat import IGNORE_INDEX, _check_messages, has_chat_template
from ._dataset import SequenceDataset, _check_args, _pad_id, split_rows
from ._preference import PreferenceDataset, _check_pair, _common_prefix, _tokenize
from ._sources import jsonl_rows

log = logging.getLogger(__name__)
UNPAIR_CHUNK = 1000  # TRL unpairs with a batched map: its default batch of 1000 rows


class UnpairedDataset(PreferenceDataset):
    """Examples as row pairs: ``chosen[i]`` is example i's prompt and completion, ``rejected[i]``
    the same prompt with the mismatched KL completion; ``desirable[i]`` its label.

    A batch of ``B`` examples is ``2B`` rows, the completions first, plus ``desirable`` (``[B]``
    bool) and whatever :meth:`with_values` attached (``ref_logps``: ``[2B]``).
    """

    def __init__(self, chosen: SequenceDataset, rejected: SequenceDataset, desirable: torch.Tensor,
                 values: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(chosen, rejected, values)
        self.desirable = desirable
        self.kind = "unpaired preference"

    def subset(self, index: torch.Tensor) -> UnpairedDataset:
        return UnpairedDataset(self.chosen.subset(index), self.rejected.subset(index), self.desirable[index],
                               {k: v[index] for k, v in self.values.items()})

    def with_values(self, name: str, values: torch.Tensor) -> UnpairedDataset:
        both = super().with_values(name, values)
        return UnpairedDataset(self.chosen, self.rejected, self.desirable, both.values)

    def get_batch(self, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        batch = super().get_batch(indices)
        batch["desirable"] = self.desirable[torch.as_tensor(indices, dtype=torch.long)]
        return batch


def _check_unpaired(where: str, row: Any, templated: bool) -> tuple[Any, Any, bool]:
    """``(prompt, completion, label)`` of an unpaired row."""
    missing = [k for k in ("prompt", "completion", "label") if k not in row]
    if missing:
        raise DataError(f"{where}: unpaired preference rows need 'prompt', 'completion' and 'label', "
                        f"missing {', '.join(repr(k) for k in missing)}")
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not isinstance(label, bool):
        raise DataError(f"{where}: 'label' must be true (a desirable completion) or false, got {label!r}")
    if isinstance(completion, list):
        if not templated:
            raise DataError(f"{where}: conversational rows need a tokenizer with a chat template, and this one "
                            f"has none; use plain-text rows or an instruct model")
        completion = _check_messages(where, completion)
        if not isinstance(prompt, list):
            raise DataError(f"{where}: 'prompt' must be a list of messages like 'completion', "
                            f"got {type(prompt).__name__}")
        prompt = _check_messages(where, prompt)
    elif not isinstance(completion, str):
        raise DataError(f"{where}: 'completion' must be a string or messages, got {type(completion).__name__}")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' must be a string like 'completion', got {type(prompt).__name__}")
    if not completion:
        raise DataError(f"{where}: 'completion' is empty: every example needs a non-empty completion")
    return prompt, completion, label


def _examples(tokenizer, rows: list[tuple[str, Any]]) -> list[tuple[str, Any, Any, bool]]:
    """``(where, prompt, completion, label)`` of every row, paired rows unpaired as TRL does."""
    templated = has_chat_template(tokenizer)
    paired = isinstance(rows[0][1], dict) and "chosen" in rows[0][1]
    out = []
    for start in range(0, len(rows), UNPAIR_CHUNK if paired else len(rows)):
        chunk, rejected = rows[start:start + UNPAIR_CHUNK] if paired else rows[start:], []
        for where, row in chunk:
            if not isinstance(row, dict) or ("chosen" in row) != paired:
                want = "'prompt', 'chosen' and 'rejected' like" if paired else "'prompt', 'completion' and " \
                                                                                "'label' like"
                raise DataError(f"{where}: this row's fields do not match the file's first row; give every row "
                                f"{want} the first")
            if paired:
                prompt, chosen, rej = _check_pair(where, row, templated)
                out.append((where, prompt, chosen, True))
                rejected.append((where, prompt, rej, False))
            else:
                out.append((where, *_check_unpaired(where, row, templated)))
        out += rejected
    return out


def encode_unpaired(tokenizer, where: str, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)`` of one example, as TRL's KTOTrainer tokenizes it.

    Raises:
        DataError: the completion tokenizes to nothing after the prompt, naming ``where``.
    """
    if isinstance(completion, str):
        eos = tokenizer.eos_token or ""
        completion = completion if completion.endswith(eos) else completion + eos
    prompt_ids = _tokenize(tokenizer, prompt, generation=True)
    full = _tokenize(tokenizer, prompt + completion)
    n = _common_prefix(prompt_ids, full)
    if len(full) == n:
        raise DataError(f"{where}: the completion tokenizes to nothing after the prompt")
    return prompt_ids[:n], full[n:]


def _pad(rows: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> SequenceDataset:
    """``(prompt, completion)`` token lists → rows cut to ``seq_len`` (the start kept), labels on
    the completion; none dropped (a KL row left with no label scores 0, as in TRL)."""
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int32)
    mask = np.zeros((n, seq_len), dtype=np.uint8)
    for i, (p, c) in enumerate(rows):
        x, y = (p + c)[:seq_len], ([IGNORE_INDEX] * len(p) + c)[:seq_len]
        ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = x, y, 1
    return SequenceDataset(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(mask), kind="chat")


def _rows(examples: list[tuple[list[int], list[int], bool]], batch_size: int, seq_len: int,
          pad_id: int) -> UnpairedDataset:
    """The dataset of ``examples`` in order, each with its KL row: the completions rotated by one
    within each run of ``batch_size`` (TRL's ``KL_completion_ids``)."""
    kl = []
    for start in range(0, len(examples), batch_size):
        chunk = [c for _, c, _ in examples[start:start + batch_size]]
        kl += chunk[-1:] + chunk[:-1]
    return UnpairedDataset(_pad([(p, c) for p, c, _ in examples], seq_len, pad_id),
                           _pad([(p, k) for (p, _, _), k in zip(examples, kl)], seq_len, pad_id),
                           torch.tensor([d for _, _, d in examples], dtype=torch.bool))


def build_unpaired_datasets(spec: str | Path, tokenizer, seq_len: int, batch_size: int, *, seed: int = 0,
                            val_fraction: float = 0.02, max_bytes: int = 0
                            ) -> tuple[UnpairedDataset, UnpairedDataset]:
    """A JSONL file (or folder) of unpaired (or paired) preference rows → ``(train, val)``
    examples, split by a seeded permutation, each part's KL rows built in ``batch_size`` runs.

    Raises:
        DataError: no JSONL, a bad row (naming its file and line), or no example whose prompt
            leaves room for its completion in ``seq_len``.
    """
    _check_args(seq_len, val_fraction, max_bytes)
    fields = "'prompt', 'completion' and 'label'"
    rows = jsonl_rows(spec, max_bytes, reads="objective kto reads", fields=fields,
                      given=f"{fields} (or paired 'chosen' / 'rejected')")
    encoded = [(*encode_unpaired(tokenizer, where, p, c), label) for where, p, c, label in _examples(tokenizer, rows)]
    if isinstance(rows[0][1], dict) and "chosen" in rows[0][1]:
        log.warning("%s: pairs unpaired as TRL does, each 1000 pairs' chosen completions before their rejected "
                    "ones; KTO's batches keep that order, so write unpaired rows to mix the labels", spec)
    # as TRL: an example trains when its prompt leaves room for a completion token
    kept = [e for e in encoded if len(e[0]) < seq_len and (e[0] or len(e[1]) > 1)]
    if not kept:
        raise DataError(f"data={str(spec)!r}: no example's prompt leaves room for a completion in "
                        f"seq_len={seq_len} tokens; raise seq_len")
    if len(kept) < len(encoded):
        log.warning("dropped %d of %d examples whose prompt alone fills seq_len=%d", len(encoded) - len(kept),
                    len(encoded), seq_len)
    train, val = split_rows(len(kept), val_fraction, seed, label=str(spec), seq_len=seq_len)
    pad = _pad_id(tokenizer)
    return (_rows([kept[i] for i in train.tolist()], batch_size, seq_len, pad),
            _rows([kept[i] for i in val.tolist()], batch_size, seq_len, pad))
