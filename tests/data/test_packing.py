"""Packed text with document boundaries (``padding_free``, TRL's name): position ids restart
at each document, a document's first token has no label, and what cannot keep boundaries is
refused in one line."""
from __future__ import annotations

import pytest
import torch

from outcore.data import build_datasets, document_positions, tokenize_documents
from outcore.errors import ConfigError
from tests.data.conftest import make_tokenizer


def test_positions_restart_after_each_eos_and_at_each_row():
    eos = 9
    rows = torch.tensor([[5, 6, 9, 7, 8, 9, 4],
                         [1, 9, 9, 2, 3, 4, 5]])
    assert document_positions(rows, eos).tolist() == [[0, 1, 2, 0, 1, 2, 0],
                                                      [0, 1, 0, 0, 1, 2, 3]]


def _docs(tmp_path, texts):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i:02d}.txt").write_text(text)
    return folder


def test_packed_rows_carry_document_positions_and_no_cross_document_label(tmp_path, tok):
    texts = ["To be, or not to be, that is the question.", "The slings and arrows.",
             "Or to take arms against a sea of troubles, and by opposing end them."] * 3
    folder = _docs(tmp_path, texts)
    seq = 16
    plain, _ = build_datasets(folder, tok, seq, val_fraction=0, use_cache=False)
    packed, _ = build_datasets(folder, tok, seq, val_fraction=0, use_cache=False, padding_free=True)
    rows = list(range(len(packed)))
    a, b = plain.get_batch(rows), packed.get_batch(rows)
    assert set(b) == {"input_ids", "labels", "position_ids"}  # no mask: it would hide the documents
    assert torch.equal(a["input_ids"], b["input_ids"])  # the same tokens, the same rows
    flat = b["input_ids"].flatten()
    assert torch.equal(flat, tokenize_documents(tok, texts)[:flat.numel()].long())
    positions = b["position_ids"]
    assert torch.equal(positions, document_positions(b["input_ids"], tok.eos_token_id).long())
    starts = positions == 0
    assert int(starts[:, 1:].sum()) >= 3  # documents do start inside rows here
    assert (b["labels"][starts] == -100).all()
    assert torch.equal(b["labels"][~starts], a["labels"][~starts])


def test_jsonl_rows_and_a_tokenizer_without_eos_are_refused(tmp_path, tok):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "Say hi.", "output": "Hi there!"}\n' * 4)
    with pytest.raises(ConfigError, match="padding_free=true .* is JSONL") as err:
        build_datasets(rows, tok, 32, val_fraction=0, padding_free=True)
    assert "\n" not in str(err.value)
    folder = _docs(tmp_path, ["To be, or not to be, that is the question."] * 4)
    with pytest.raises(ConfigError, match="EOS token"):
        build_datasets(folder, make_tokenizer(eos=False), 8, val_fraction=0, use_cache=False, padding_free=True)


def test_config_refuses_padding_free_for_an_objective_of_examples():
    from outcore.training.config import load_config

    assert load_config(overrides=["padding_free=true"]).padding_free is True
    with pytest.raises(ConfigError, match="padding_free=true packs text for objective 'sft'"):
        load_config(overrides=["padding_free=true", "objective=dpo"])
