"""JSONL instruction and chat rows → token ids with loss only on the answer.

Two row shapes are accepted (per row, so a file may mix them):

- instruction data: ``{"instruction": str, "input": str (optional), "output": str}``;
- chat data: ``{"messages": [{"role": str, "content": str}, ...]}``.

With a chat template (SmolLM2-Instruct has one) an instruction row becomes a
user turn and an assistant turn, so both shapes go through one path: the
conversation is rendered with the template, and the character spans of the
assistant turns are found by rendering prefixes incrementally — the text the
template adds for assistant turn *i* is ``render(messages[:i+1])`` minus
``render(messages[:i], add_generation_prompt=True)``. Tokens whose characters
start inside such a span (the answer and its end-of-turn marker) carry loss;
every other token gets label -100. Without a chat template instruction rows use
the Alpaca prompt, and the output (plus EOS) carries the loss.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np
import torch

from ..errors import DataError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _check_messages(where: str, messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of "
                        f"{{'role': ..., 'content': ...}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: messages[{i}] needs string 'role' and 'content' fields, "
                            f"got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_instruction(where: str, row: dict[str, Any]) -> tuple[str, str, str]:
    if not ("instruction" in row and "output" in row):
        raise DataError(f"{where}: row has keys {sorted(row)}; it needs 'instruction' and "
                        f"'output' (and optionally 'input') for instruction data, or "
                        f"'messages' for chat data")
    values = {k: row.get(k) if row.get(k) is not None else "" for k in
              ("instruction", "input", "output")}
    for key, value in values.items():
        if not isinstance(value, str):
            raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return values["instruction"], values["input"], values["output"]


def _render(tokenizer, where: str, messages: list[dict[str, str]], generation: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation)
    except Exception as err:  # jinja raises its own errors (e.g. "roles must alternate")
        raise DataError(f"{where}: the tokenizer's chat template rejects this conversation: "
                        f"{err}") from err


def assistant_spans(tokenizer, where: str, messages: list[dict[str, str]]
                    ) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and find the character spans of its assistant turns.

    Args:
        tokenizer: a tokenizer with a chat template.
        where: ``file:line`` for messages.
        messages: the validated conversation.

    Returns:
        ``(text, spans)``: the rendered conversation and ``[start, end)`` character
        ranges that carry loss.

    Raises:
        DataError: the template rejects the conversation, or an assistant turn
            cannot be located in the rendered text.
    """
    text = _render(tokenizer, where, messages, generation=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, where, messages[:i], generation=True) if i else None
        through = _render(tokenizer, where, messages[: i + 1], generation=False)
        if (before is not None and through.startswith(before) and text.startswith(through)
                and len(before) >= cursor):
            start, end = len(before), len(through)
        else:  # templates that rewrite earlier turns: fall back to finding the content
            start = text.find(message["content"], cursor)
            if start < 0:
                raise DataError(f"{where}: cannot locate assistant message {i} in the text the "
                                f"chat template renders; use instruction/output rows instead")
            end = start + len(message["content"])
        if end > start:
            spans.append((start, end))
        cursor = end
    return text, spans


def _encode_chat(tokenizer, items: list[tuple[str, list[dict[str, str]]]]
                 ) -> list[tuple[list[int], list[int]]]:
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("chat data needs a fast tokenizer (character offsets locate the "
                        "assistant tokens); load the model's tokenizer.json")
    rendered = [assistant_spans(tokenizer, where, messages) for where, messages in items]
    enc = tokenizer([text for text, _ in rendered], add_special_tokens=False,
                    return_offsets_mapping=True)
    out = []
    for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered):
        starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
        keep = np.zeros(len(ids), dtype=bool)
        for s, e in spans:
            keep |= (starts >= s) & (starts < e)
        labels = np.where(keep, np.asarray(ids, dtype=np.int64), IGNORE_INDEX)
        out.append((list(ids), labels.tolist()))
    return out


def _encode_alpaca(tokenizer, items: list[tuple[str, str, str]]
                   ) -> list[tuple[list[int], list[int]]]:
    prompts = [(ALPACA_WITH_INPUT if inp else ALPACA_NO_INPUT).format(instruction=ins, input=inp)
               for ins, inp, _ in items]
    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer([out for _, _, out in items], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for p, a in zip(prompt_ids, answer_ids):
        answer = list(a) + eos
        out.append((list(p) + answer, [IGNORE_INDEX] * len(p) + answer))
    return out


def encode_rows(tokenizer, rows: Iterable[tuple[str, dict[str, Any]]]
                ) -> tuple[list[tuple[list[int], list[int]]], str]:
    """Validate and tokenize JSONL rows.

    Args:
        tokenizer: the model's tokenizer.
        rows: ``("file:line", row)`` pairs (see :func:`._sources.iter_jsonl`).

    Returns:
        ``(examples, kind)``: per row ``(input_ids, labels)`` (labels -100 off the
        answer), and ``"chat"``, ``"instruction"`` or ``"mixed"``.

    Raises:
        DataError: a row lacks the needed keys or has values of the wrong type
            (naming ``file:line``), or chat rows meet a tokenizer without a template.
    """
    templated = has_chat_template(tokenizer)
    chats: list[tuple[int, str, list[dict[str, str]]]] = []
    alpaca: list[tuple[int, tuple[str, str, str]]] = []
    kinds = set()
    for n, (where, row) in enumerate(rows):
        if "messages" in row:
            kinds.add("chat")
            if not templated:
                raise DataError(f"{where}: chat data needs a tokenizer with a chat template, and "
                                f"this one has none; use an instruct model or instruction/output "
                                f"rows")
            chats.append((n, where, _check_messages(where, row["messages"])))
            continue
        kinds.add("instruction")
        instruction, inp, output = _check_instruction(where, row)
        if templated:
            user = instruction + ("\n\n" + inp if inp else "")
            chats.append((n, where, [{"role": "user", "content": user},
                                     {"role": "assistant", "content": output}]))
        else:
            alpaca.append((n, (instruction, inp, output)))
    encoded: dict[int, tuple[list[int], list[int]]] = {}
    if chats:
        encoded.update(zip((n for n, _, _ in chats),
                           _encode_chat(tokenizer, [(w, m) for _, w, m in chats])))
    if alpaca:
        encoded.update(zip((n for n, _ in alpaca), _encode_alpaca(tokenizer, [r for _, r in alpaca])))
    kind = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "instruction")
    return [encoded[n] for n in sorted(encoded)], kind


def pad_examples(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Truncate/pad examples to ``seq_len`` and drop those left with no loss token.

    Args:
        examples: ``(input_ids, labels)`` pairs of any length.
        seq_len: the row length.
        pad_id: id used for padding (its label is -100 and its attention mask 0).

    Returns:
        ``(input_ids, labels, attention_mask, dropped)``: ``[n, seq_len]`` int32,
        int32 and uint8 tensors, and how many examples were dropped because
        truncation removed all of their answer tokens.
    """
    n = len(examples)
    ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int32)
    mask = np.zeros((n, seq_len), dtype=np.uint8)
    keep = np.zeros(n, dtype=bool)
    for row, (x, y) in enumerate(examples):
        length = min(len(x), seq_len)
        ids[row, :length] = x[:length]
        labels[row, :length] = y[:length]
        mask[row, :length] = 1
        keep[row] = bool((labels[row, 1:length] != IGNORE_INDEX).any())  # position 0 is never a target
    dropped = int(n - keep.sum())
    return (torch.from_numpy(ids[keep]), torch.from_numpy(labels[keep]),
            torch.from_numpy(mask[keep]), dropped)
