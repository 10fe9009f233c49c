"""Preference data (TRL's format) → paired token rows: a chosen and a rejected completion
of each prompt, with loss only on the completions.

A JSONL row is ``{"prompt", "chosen", "rejected"}``, each a string (plain text) or a list of
``{"role", "content"}`` messages (conversational: the prompt's turns, then the assistant's); a
conversational row may leave the prompt implicit, as the turns ``chosen`` and ``rejected``
share (TRL's ``extract_prompt``).

Tokenized as TRL's ``DPOTrainer`` does, so a data set gives the same token rows here as
there: plain text is ``prompt`` and ``prompt + completion + EOS`` tokenized whole;
conversations go through the chat template (the prompt with the generation prompt); the
completion starts where the two token lists first differ. Rows are cut to ``seq_len`` from
the end (the prompt is kept), and a pair whose prompt alone fills ``seq_len`` is dropped.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import DataError
from ._chat import IGNORE_INDEX, _check_messages, has_chat_template, pad_examples
from ._dataset import SequenceDataset, _check_args, _pad_id, split_rows
from ._sources import jsonl_rows

log = logging.getLogger(__name__)


class PreferenceDataset:
    """Pairs of rows: ``chosen[i]`` and ``rejected[i]`` complete the same prompt.

    A batch of ``B`` pairs is ``2B`` rows, the chosen ones first (``[B, T]`` each half), plus
    whatever per-row values were attached with :meth:`with_values` (``ref_logps``: ``[2B]``).
    """

    def __init__(self, chosen: SequenceDataset, rejected: SequenceDataset,
                 values: dict[str, torch.Tensor] | None = None) -> None:
        if len(chosen) != len(rejected):
            raise ValueError(f"{len(chosen)} chosen rows but {len(rejected)} rejected rows")
        self.chosen, self.rejected = chosen, rejected
        self.values = values or {}  # name -> [len, 2] per pair: (chosen, rejected)
        self.kind = "preference"

    @property
    def seq_len(self) -> int:
        return self.chosen.seq_len

    @property
    def num_tokens(self) -> int:
        return self.chosen.num_tokens + self.rejected.num_tokens

    def __len__(self) -> int:
        return len(self.chosen)

    def subset(self, index: torch.Tensor) -> PreferenceDataset:
        return PreferenceDataset(self.chosen.subset(index), self.rejected.subset(index),
                                 {k: v[index] for k, v in self.values.items()})

    def with_values(self, name: str, values: torch.Tensor) -> PreferenceDataset:
        """This dataset with ``values`` (``[len, 2]``: per pair, chosen then rejected) in its batches."""
        if values.shape != (len(self), 2):
            raise ValueError(f"{name} has shape {tuple(values.shape)}, expected ({len(self)}, 2)")
        return PreferenceDataset(self.chosen, self.rejected, {**self.values, name: values})

    def get_batch(self, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Pairs ``indices`` as ``2B`` rows (chosen first) and their attached values (``[2B]``)."""
        c, r = self.chosen.get_batch(indices), self.rejected.get_batch(indices)
        batch = {k: torch.cat([c[k], r[k]]) for k in c}
        pos = torch.as_tensor(indices, dtype=torch.long)
        for name, v in self.values.items():
            batch[name] = torch.cat([v[pos, 0], v[pos, 1]])
        return batch


def _tokenize(tokenizer, value: str | list[dict[str, str]], generation: bool = False) -> list[int]:
    if isinstance(value, list):
        out = tokenizer.apply_chat_template(value, tokenize=True, add_generation_prompt=generation,
                                            return_dict=True)
        return list(out["input_ids"])
    return list(tokenizer(value)["input_ids"])


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_pair(where: str, row: Any, templated: bool) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a row, each a string or a validated message list."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataError(f"{where}: preference rows need 'chosen' and 'rejected' (and 'prompt'), got {keys}")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    conversational = isinstance(chosen, list)
    if conversational and not templated:
        raise DataError(f"{where}: conversational rows need a tokenizer with a chat template, and this one has "
                        f"none; use plain-text rows or an instruct model")
    if conversational:
        chosen, rejected = _check_messages(where, chosen), _check_messages(where, rejected)
        if prompt is None:  # implicit prompt: the turns both share
            n = _common_prefix(chosen, rejected)
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        elif not isinstance(prompt, list):
            raise DataError(f"{where}: 'prompt' must be a list of messages like 'chosen', got {type(prompt).__name__}")
        else:
            prompt = _check_messages(where, prompt)
    elif prompt is None:
        raise DataError(f"{where}: plain-text preference rows need a 'prompt' field")
    for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, (str, list)) or isinstance(value, str) != isinstance(chosen, str):
            raise DataError(f"{where}: '{name}' must be {'a string' if isinstance(chosen, str) else 'messages'} "
                            f"like 'chosen', got {type(value).__name__}")
        if name != "prompt" and not value:
            raise DataError(f"{where}: '{name}' is empty: every pair needs two non-empty completions")
    return prompt, chosen, rejected


def encode_pair(tokenizer, where: str, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of one JSONL row, as TRL tokenizes it.

    Raises:
        DataError: a missing or empty field, naming ``where`` (``file:line``).
    """
    prompt, chosen, rejected = _check_pair(where, row, has_chat_template(tokenizer))
    if isinstance(chosen, str):
        eos = tokenizer.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
    prompt_ids = _tokenize(tokenizer, prompt, generation=True)
    full_c, full_r = _tokenize(tokenizer, prompt + chosen), _tokenize(tokenizer, prompt + rejected)
    n = min(_common_prefix(prompt_ids, full_c), _common_prefix(prompt_ids, full_r))
    if len(full_c) == n or len(full_r) == n:
        raise DataError(f"{where}: a completion tokenizes to nothing after the prompt")
    return prompt_ids[:n], full_c[n:], full_r[n:]


def _rows(prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
    return prompt + completion, [IGNORE_INDEX] * len(prompt) + completion


def build_preference_datasets(spec: str | Path, tokenizer, seq_len: int, *, seed: int = 0,
                              val_fraction: float = 0.02, max_bytes: int = 0
                              ) -> tuple[PreferenceDataset, PreferenceDataset]:
    """A JSONL preference file (or folder of them) → ``(train, val)`` pairs, split by a seeded
    permutation as :func:`build_datasets` splits rows.

    Raises:
        DataError: no JSONL, a bad row (naming its file and line), or no pair left whose prompt
            leaves room for its completions in ``seq_len``.
    """
    _check_args(seq_len, val_fraction, max_bytes)
    rows = jsonl_rows(spec, max_bytes, reads="preference objectives read", fields="'prompt', 'chosen' and 'rejected'")
    pairs = [encode_pair(tokenizer, where, row) for where, row in rows]
    # a pair trains when both rows keep a label past position 0 (never a target) within seq_len
    kept = [(p, c, r) for p, c, r in pairs if len(p) < seq_len and (p or min(len(c), len(r)) > 1)]
    if not kept:
        raise DataError(f"data={str(spec)!r}: no pair's prompt leaves room for a completion in seq_len={seq_len} "
                        f"tokens; raise seq_len")
    if len(kept) < len(pairs):
        log.warning("dropped %d of %d pairs whose prompt alone fills seq_len=%d", len(pairs) - len(kept),
                    len(pairs), seq_len)
    pad = _pad_id(tokenizer)
    chosen = pad_examples([_rows(p, c) for p, c, _ in kept], seq_len, pad)
    rejected = pad_examples([_rows(p, r) for p, _, r in kept], seq_len, pad)
    both = PreferenceDataset(SequenceDataset(*chosen[:3], kind="chat"), SequenceDataset(*rejected[:3], kind="chat"))
    train, val = split_rows(len(both), val_fraction, seed, label=str(spec), seq_len=seq_len)
    return both.subset(train), both.subset(val)
