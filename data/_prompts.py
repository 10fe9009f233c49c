"""Prompt-only data (TRL's format) for GRPO: the prompts a policy completes, and the columns
its reward functions read.

A JSONL row is ``{"prompt": ..., **columns}``: the prompt a string (plain text) or a list of
``{"role", "content"}`` messages (conversational: the chat template is applied with the
generation prompt, as for SFT); every other field (an ``answer``, say) is handed to the reward
functions as TRL hands its dataset's columns: one list per column, a value per completion.

A prompt is tokenized once, here; a prompt longer than ``max_prompt`` tokens keeps its last
``max_prompt`` (TRL cuts ``max_prompt_length`` on the left), so a prompt and its completion
fit in ``seq_len``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import DataError
from ._chat import _check_messages, has_chat_template
from ._dataset import _check_args, split_rows
from ._sources import jsonl_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One row: its prompt as given (for the reward functions), its tokens and its other columns."""

    prompt: str | list[dict[str, str]]
    ids: list[int]
    columns: dict[str, Any]


class PromptDataset:
    """Prompts to complete; a batch is their positions (``{"index": [B]}``), read back with
    :meth:`rows` (a loader's state is then two integers, as for token rows)."""

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self.prompts = list(prompts)
        self.kind = "prompts"

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, index: torch.Tensor) -> PromptDataset:
        return PromptDataset([self.prompts[int(i)] for i in index])

    def get_batch(self, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        return {"index": torch.as_tensor(indices, dtype=torch.long)}

    def rows(self, batch: dict[str, torch.Tensor]) -> list[Prompt]:
        """The prompts of a batch :meth:`get_batch` made."""
        return [self.prompts[int(i)] for i in batch["index"]]


def encode_prompt(tokenizer, where: str, row: Any, max_prompt: int) -> Prompt:
    """One JSONL row as a :class:`Prompt`.

    Raises:
        DataError: no ``prompt``, an empty one, a conversation without a chat template, naming
            ``where`` (``file:line``).
    """
    if not isinstance(row, dict) or "prompt" not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataError(f"{where}: prompt-only rows need a 'prompt' field (and the columns the reward functions "
                        f"read), got {keys}")
    prompt = row["prompt"]
    if isinstance(prompt, list):
        if not has_chat_template(tokenizer):
            raise DataError(f"{where}: a conversational 'prompt' needs a tokenizer with a chat template, and this "
                            f"one has none; use plain-text prompts or an instruct model")
        prompt = _check_messages(where, prompt)
        ids = list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"])
    elif isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        raise DataError(f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")
    if not ids or (isinstance(prompt, str) and not prompt.strip()):
        raise DataError(f"{where}: 'prompt' is empty; every row needs a prompt to complete")
    return Prompt(prompt, ids[-max_prompt:], {k: v for k, v in row.items() if k != "prompt"})


def build_prompt_datasets(spec: str | Path, tokenizer, seq_len: int, max_completion_length: int, *, seed: int = 0,
                          val_fraction: float = 0.02, max_bytes: int = 0) -> tuple[PromptDataset, PromptDataset]:
    """A JSONL prompt file (or folder of them) → ``(train, val)`` prompts, split by a seeded
    permutation as :func:`build_datasets` splits rows.

    Args:
        seq_len: the longest prompt + completion, in tokens.
        max_completion_length: the most tokens a completion has (a prompt keeps at most
            ``seq_len - max_completion_length``).

    Raises:
        DataError: no JSONL, no row, or a bad row (naming its file and line).
    """
    _check_args(seq_len, val_fraction, max_bytes)
    rows = jsonl_rows(spec, max_bytes, reads="objective 'grpo' reads", fields="a 'prompt'",
                      given="a 'prompt' (and the columns the reward functions read)")
    max_prompt = seq_len - max_completion_length
    prompts = [encode_prompt(tokenizer, where, row, max_prompt) for where, row in rows]
    cut = sum(len(p.ids) == max_prompt for p in prompts)
    if cut:
        log.warning("%d prompt(s) reach seq_len - max_completion_length = %d tokens and may have been cut on the "
                    "left", cut, max_prompt)
    both = PromptDataset(prompts)
    train, val = split_rows(len(both), val_fraction, seed, label=str(spec), seq_len=seq_len)
    return both.subset(train), both.subset(val)
