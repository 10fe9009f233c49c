"""JSONL instruction and chat data: loss only on the answer tokens, and the row errors."""
from __future__ import annotations

import json

import pytest
import torch

from outcore.data import IGNORE_INDEX, assistant_spans, build_datasets, encode_rows
from outcore.errors import DataError


def _jsonl(tmp_path, rows, name="d.jsonl"):
    f = tmp_path / name
    f.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return f


def _loss_text(tokenizer, row):
    labels = row["labels"]
    return tokenizer.decode(labels[labels != IGNORE_INDEX])


def _rows(ds):
    return [ds[i] for i in range(len(ds))]


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is two plus two?"},
                     {"role": "assistant", "content": "Four."},
                     {"role": "user", "content": "Say hi."},
                     {"role": "assistant", "content": "Hi there!"}]}


def test_chat_loss_only_on_assistant_turns(tok, tmp_path):
    f = _jsonl(tmp_path, [CHAT])
    train, val = build_datasets(str(f), tok, 128, val_fraction=0)
    assert len(val) == 0 and train.kind == "chat"
    row = train[0]
    assert _loss_text(tok, row) == "Four.<|im_end|>\nHi there!<|im_end|>\n"
    n = int(row["attention_mask"].sum())
    text = tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert tok.decode(row["input_ids"][:n]) == text


def test_instruction_rows_use_the_chat_template(tok, tmp_path):
    f = _jsonl(tmp_path, [{"instruction": "Say hi.", "input": "Politely", "output": "Hi there!"}])
    row = build_datasets(str(f), tok, 64, val_fraction=0)[0][0]
    n = int(row["attention_mask"].sum())
    assert tok.decode(row["input_ids"][:n]) == (
        "<|im_start|>user\nSay hi.\n\nPolitely<|im_end|>\n<|im_start|>assistant\nHi there!<|im_end|>\n")
    assert _loss_text(tok, row) == "Hi there!<|im_end|>\n"


def test_instruction_rows_without_template_use_alpaca(tok_plain, tmp_path):
    f = _jsonl(tmp_path, [{"instruction": "Say hi.", "output": "Hi there!"},
                          {"instruction": "Add.", "input": "2+2", "output": "4"}])
    train, _ = build_datasets(str(f), tok_plain, 512, val_fraction=0)
    assert train.kind == "instruction"
    first, second = _rows(train)
    n = int(first["attention_mask"].sum())
    assert tok_plain.decode(first["input_ids"][:n]).endswith("### Response:\nHi there!<eos>")
    assert "### Input:" not in tok_plain.decode(first["input_ids"][:n])
    assert "### Input:\n2+2" in tok_plain.decode(second["input_ids"])
    assert _loss_text(tok_plain, first) == "Hi there!<eos>"
    assert _loss_text(tok_plain, second) == "4<eos>"


def test_padding_uses_pad_id_no_loss_no_attention(tok, tmp_path):
    f = _jsonl(tmp_path, [{"instruction": "Hi", "output": "Four."}])
    row = build_datasets(str(f), tok, 64, val_fraction=0)[0][0]
    n = int(row["attention_mask"].sum())
    assert 0 < n < 64 and bool(row["attention_mask"][:n].all())
    assert (row["input_ids"][n:] == tok.pad_token_id).all()
    assert (row["labels"][n:] == IGNORE_INDEX).all()


def test_truncation_drops_rows_whose_answer_is_cut_off(tok, tmp_path, caplog):
    rows = [{"instruction": "Hi", "output": "Four."},
            {"instruction": "To be or not to be " * 20, "output": "Four."}]
    f = _jsonl(tmp_path, rows)
    with caplog.at_level("WARNING"):
        train, _ = build_datasets(str(f), tok, 24, val_fraction=0)
    assert len(train) == 1 and "dropped 1 of 2 rows" in caplog.text
    with pytest.raises(DataError, match=r"no row of .* keeps an answer token within seq_len=4 .* "
                                        r"raise seq_len"):
        build_datasets(str(f), tok, 4, val_fraction=0)


def test_template_that_rewrites_turns_falls_back_to_content_search(tokenizer_factory, tmp_path):
    # The generation prompt ("<|im_start|>assistant\n") is not a prefix of how an assistant
    # turn renders ("<|im_start|>assistant: ..."): the incremental-prefix method cannot apply.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = tokenizer_factory(chat_template=template)
    f = _jsonl(tmp_path, [CHAT])
    row = build_datasets(str(f), t, 128, val_fraction=0)[0][0]
    assert _loss_text(t, row) == "Four.Hi there!"


def test_assistant_spans_cover_exactly_the_turns(tok):
    text, spans = assistant_spans(tok, "x:1", CHAT["messages"])
    assert [text[s:e] for s, e in spans] == ["Four.<|im_end|>\n", "Hi there!<|im_end|>\n"]


def test_real_smollm2_template_masks_assistant_tokens(smol_tokenizer):
    examples, kind = encode_rows(smol_tokenizer, [("x:1", CHAT)])
    ids, labels = examples[0]
    kept = [i for i, y in zip(ids, labels) if y != IGNORE_INDEX]
    assert kind == "chat"
    assert smol_tokenizer.decode(kept) == "Four.<|im_end|>\nHi there!<|im_end|>\n"
    assert labels[: len(ids) // 3] == [IGNORE_INDEX] * (len(ids) // 3)  # system+user: no loss


def test_mixed_rows_in_one_file(tok, tmp_path):
    f = _jsonl(tmp_path, [CHAT, {"instruction": "Say hi.", "output": "Hi there!"}])
    train, _ = build_datasets(str(f), tok, 128, val_fraction=0)
    assert train.kind == "mixed" and len(train) == 2
    assert _loss_text(tok, train[1]) == "Hi there!<|im_end|>\n"  # file order is kept


def test_row_without_needed_keys_names_file_and_line(tok, tmp_path):
    f = _jsonl(tmp_path, [{"instruction": "a", "output": "b"}, {"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=rf"{f.name}:2: row has keys \['completion', 'prompt'\]; it "
                                        r"needs 'instruction' and 'output'"):
        build_datasets(str(f), tok, 32)


def test_wrong_value_type_names_file_and_line(tok, tmp_path):
    f = _jsonl(tmp_path, [{"instruction": "a", "output": 4}])
    with pytest.raises(DataError, match=rf"{f.name}:1: 'output' must be a string, got int"):
        build_datasets(str(f), tok, 32)


@pytest.mark.parametrize("messages, pattern", [
    ([], "'messages' must be a non-empty list"),
    ("hello", "'messages' must be a non-empty list"),
    ([{"role": "user"}], r"messages\[0\] needs string 'role' and 'content'"),
    ([{"role": "user", "content": "hi"}, {"role": 3, "content": "x"}], r"messages\[1\]"),
])
def test_malformed_messages(tok, tmp_path, messages, pattern):
    f = _jsonl(tmp_path, [{"messages": messages}])
    with pytest.raises(DataError, match=rf"{f.name}:1: {pattern}"):
        build_datasets(str(f), tok, 32)


def test_chat_rows_need_a_template(tok_plain, tmp_path):
    f = _jsonl(tmp_path, [CHAT])
    with pytest.raises(DataError, match=rf"{f.name}:1: chat data needs a tokenizer with a chat "
                                        r"template"):
        build_datasets(str(f), tok_plain, 32)


def test_template_errors_name_the_row(tokenizer_factory, tmp_path):
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}")
    t = tokenizer_factory(chat_template=strict)
    f = _jsonl(tmp_path, [CHAT])
    with pytest.raises(DataError, match=rf"{f.name}:1: the tokenizer's chat template rejects this "
                                        r"conversation: no system role"):
        build_datasets(str(f), t, 32)


def test_malformed_jsonl_through_build(tok, tmp_path):
    f = _jsonl(tmp_path, [{"instruction": "a", "output": "b"}, "{oops"])
    with pytest.raises(DataError, match=rf"{f.name}:2: not valid JSON"):
        build_datasets(str(f), tok, 32)


def test_empty_jsonl(tok, tmp_path):
    f = _jsonl(tmp_path, [])
    with pytest.raises(DataError, match=r"has no rows"):
        build_datasets(str(f), tok, 32)


def test_batches_are_int64(tok, tmp_path):
    f = _jsonl(tmp_path, [CHAT] * 3)
    train, _ = build_datasets(str(f), tok, 64, val_fraction=0)
    batch = train.get_batch([0, 2])
    assert all(v.dtype == torch.int64 and v.shape == (2, 64) for v in batch.values())
