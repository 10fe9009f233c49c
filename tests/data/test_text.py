"""Text → ids → packed rows, and the on-disk token cache."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from outcore.data import build_datasets, load_text_tokens, pack_sequences, tokenize_documents
from outcore.data import _text
from outcore.errors import DataError


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_documents_are_joined_with_eos(tok):
    docs = ["To be, or not to be", "", "that is the question"]
    ids = tokenize_documents(tok, docs)
    a = tok(docs[0], add_special_tokens=False)["input_ids"]
    b = tok(docs[2], add_special_tokens=False)["input_ids"]
    assert ids.dtype == torch.int32
    assert ids.tolist() == a + [tok.eos_token_id] + b + [tok.eos_token_id]  # blank doc skipped


def test_batches_split_long_inputs_identically(tok, monkeypatch):
    docs = ["To be, or not to be. " * 20, "The slings and arrows. " * 30, "Or to take arms."]
    whole = tokenize_documents(tok, docs)
    monkeypatch.setattr(_text, "_BATCH_CHARS", 10)  # one document per tokenizer call
    assert torch.equal(tokenize_documents(tok, docs), whole)


def test_pack_drops_the_short_tail_without_copying():
    ids = torch.arange(23, dtype=torch.int32)
    rows = pack_sequences(ids, 5, label="x")
    assert rows.shape == (4, 5) and rows.data_ptr() == ids.data_ptr()
    assert rows[-1].tolist() == [15, 16, 17, 18, 19]


def test_text_rows_have_loss_everywhere(tok, tmp_path):
    f = _write(tmp_path, "t.txt", "To be, or not to be, that is the question. " * 40)
    train, val = build_datasets(str(f), tok, 16, val_fraction=0.1, use_cache=False)
    row = train[0]
    assert set(row) == {"input_ids", "labels", "attention_mask"}
    assert all(v.shape == (16,) and v.dtype == torch.int64 for v in row.values())
    assert torch.equal(row["labels"], row["input_ids"])
    assert bool(row["attention_mask"].all())
    ids = load_text_tokens([f], tok)
    all_rows = sorted(pack_sequences(ids, 16, label="x").tolist())
    got = [train[i]["input_ids"].tolist() for i in range(len(train))]
    got += [val[i]["input_ids"].tolist() for i in range(len(val))]
    assert sorted(got) == all_rows  # every packed row lands in exactly one split


def test_text_shorter_than_one_sequence(tok, tmp_path):
    f = _write(tmp_path, "short.txt", "To be.")
    with pytest.raises(DataError, match=r"tokens, shorter than one sequence of seq_len=64; add text "
                                        r"or lower seq_len"):
        build_datasets(str(f), tok, 64, use_cache=False)


def test_empty_text(tok, tmp_path):
    f = _write(tmp_path, "blank.txt", "\n\n   \n")
    with pytest.raises(DataError, match=r"'.*blank\.txt' holds no text"):
        build_datasets(str(f), tok, 8, use_cache=False)


def test_token_cache_hit_skips_tokenizing(tok, tmp_path, monkeypatch):
    f = _write(tmp_path, "t.txt", "Whether 'tis nobler in the mind to suffer. " * 30)
    cache = tmp_path / "cache"
    first = load_text_tokens([f], tok, cache_dir=cache)
    files = list((cache / "tokens").glob("*.npy"))
    assert len(files) == 1 and not list((cache / "tokens").glob(".tmp-*"))

    def boom(*a, **k):
        raise AssertionError("tokenized again despite a cache hit")

    monkeypatch.setattr(_text, "tokenize_documents", boom)
    assert torch.equal(load_text_tokens([f], tok, cache_dir=cache), first)


def test_token_cache_key_follows_file_and_options(tok, tokenizer_factory, tmp_path):
    f = _write(tmp_path, "t.txt", "The slings and arrows of outrageous fortune. " * 30)
    cache = tmp_path / "cache"
    load_text_tokens([f], tok, cache_dir=cache)
    load_text_tokens([f], tok, cache_dir=cache, max_bytes=100)
    other = tokenizer_factory(chat_template=None, eos=False)  # other EOS -> other ids
    no_eos = load_text_tokens([f], other, cache_dir=cache)
    assert len(list((cache / "tokens").glob("*.npy"))) == 3
    assert other.eos_token_id not in no_eos.tolist() or other.eos_token_id is None
    f.write_text("Or to take arms against a sea of troubles. " * 30)
    os.utime(f, ns=(1, 1))  # new content and mtime: must not hit the old entry
    fresh = load_text_tokens([f], tok, cache_dir=cache)
    assert torch.equal(fresh, tokenize_documents(tok, [f.read_text()]))


def test_damaged_cache_entry_is_rebuilt(tok, tmp_path):
    f = _write(tmp_path, "t.txt", "And by opposing end them. " * 30)
    cache = tmp_path / "cache"
    good = load_text_tokens([f], tok, cache_dir=cache)
    entry = next((cache / "tokens").glob("*.npy"))
    entry.write_bytes(b"not a numpy file")
    assert torch.equal(load_text_tokens([f], tok, cache_dir=cache), good)
    assert np.array_equal(np.load(entry), good.numpy())


def test_use_cache_false_writes_nothing(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTCORE_CACHE", str(tmp_path / "cache"))
    f = _write(tmp_path, "t.txt", "To die, to sleep. " * 40)
    build_datasets(str(f), tok, 8, use_cache=False)
    assert not (tmp_path / "cache").exists()
    build_datasets(str(f), tok, 8)  # default cache root follows OUTCORE_CACHE
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 1


def test_default_corpus_with_the_real_tokenizer(smol_tokenizer, tmp_path):
    train, val = build_datasets("default", smol_tokenizer, 128, max_bytes=40_000,
                                cache_dir=tmp_path)
    assert len(train) > 50 and len(val) >= 1
    text = smol_tokenizer.decode(torch.cat([train[0]["input_ids"], train[1]["input_ids"]]))
    assert "WELL" in text.upper()  # the sorted corpus starts with All's Well That Ends Well
