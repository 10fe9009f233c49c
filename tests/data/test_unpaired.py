"""Unpaired preference examples (KTO): tokenized as TRL's KTOTrainer tokenizes them (plain,
conversational, and paired rows unpaired), each with its KL row made within its run of
``batch_size``, one-line errors for bad rows."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from outcore.data import build_unpaired_datasets
from outcore.errors import DataError
from tests.conftest import make_tiny_llama

PLAIN = [{"prompt": "The cat", "completion": " sat on the mat.", "label": True},
         {"prompt": "Two plus two is", "completion": " five, I think", "label": False},
         {"prompt": "Paris is in", "completion": " France.", "label": True}]
CHAT = [{"prompt": [{"role": "user", "content": "Capital of France?"}],
         "completion": [{"role": "assistant", "content": "Paris."}], "label": True},
        {"prompt": [{"role": "user", "content": "2+2?"}],
         "completion": [{"role": "assistant", "content": "5"}], "label": False}]
PAIRED = [  # implicit prompts, unpaired: the chosen completions, then the rejected ones
          {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
           "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]},
          {"chosen": [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Paris."}],
           "rejected": [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Lyon, I think"}]}]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _completions(dataset, half):
    batch = dataset.get_batch(torch.arange(len(dataset)))
    n = len(dataset)
    rows = zip(batch["input_ids"][half * n:(half + 1) * n], batch["labels"][half * n:(half + 1) * n])
    return [ids[labels != -100].tolist() for ids, labels in rows]


@pytest.mark.parametrize("rows", [PLAIN, CHAT, PAIRED], ids=["plain", "conversational", "paired"])
def test_tokens_equal_trl_kto_trainer(smol_tokenizer, rows, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    model = make_tiny_llama(vocab=len(smol_tokenizer))
    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=64,
                     per_device_train_batch_size=2)
    theirs = KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                        train_dataset=Dataset.from_list(rows), processing_class=smol_tokenizer).train_dataset
    train, _ = build_unpaired_datasets(_write(tmp_path / "rows.jsonl", rows), smol_tokenizer, seq_len=64,
                                       batch_size=2, val_fraction=0.0)
    assert train.desirable.tolist() == theirs["label"]
    assert _completions(train, 0) == theirs["completion_ids"]
    assert _completions(train, 1) == theirs["KL_completion_ids"]


def test_kl_rows_rotate_within_runs_of_batch_size(smol_tokenizer, tmp_path):
    rows = [{"prompt": f"Row {i} says", "completion": f" word{i}", "label": i % 2 == 0} for i in range(5)]
    train, _ = build_unpaired_datasets(_write(tmp_path / "r.jsonl", rows), smol_tokenizer, seq_len=16,
                                       batch_size=2, val_fraction=0.0)
    main = _completions(train, 0)
    assert _completions(train, 1) == [main[1], main[0], main[3], main[2], main[4]]  # the last run: itself
    assert train.desirable.tolist() == [True, False, True, False, True]


@pytest.mark.parametrize("row,message", [
    ({"prompt": "a", "completion": "b"}, "need 'prompt', 'completion' and 'label', missing 'label'"),
    ({"completion": "b", "label": True}, "missing 'prompt'"),
    ({"prompt": "a", "completion": "", "label": False}, "'completion' is empty"),
    ({"prompt": "a", "completion": "b", "label": 1}, "'label' must be true .* or false, got 1"),
    ({"prompt": "a", "completion": 3, "label": True}, "'completion' must be a string or messages"),
    ({"prompt": ["a"], "completion": "b", "label": True}, "'prompt' must be a string like 'completion'"),
    ({"prompt": "a", "chosen": "b", "rejected": "c"}, "fields do not match the file's first row"),
])
def test_bad_rows_name_file_line_and_field(smol_tokenizer, tmp_path, row, message):
    data = _write(tmp_path / "ex.jsonl", [PLAIN[0], row])
    with pytest.raises(DataError, match=rf"ex.jsonl:2: .*{message}"):
        build_unpaired_datasets(data, smol_tokenizer, seq_len=16, batch_size=2)


def test_text_data_empty_files_and_prompts_filling_seq_len_are_refused(smol_tokenizer, tmp_path):
    with pytest.raises(DataError, match="objective kto reads JSONL rows with 'prompt', 'completion' and 'label'"):
        build_unpaired_datasets(_write(tmp_path / "a.txt", []), smol_tokenizer, seq_len=16, batch_size=2)
    with pytest.raises(DataError, match="empty.jsonl' has no rows"):
        build_unpaired_datasets(_write(tmp_path / "empty.jsonl", []), smol_tokenizer, seq_len=16, batch_size=2)
    long = [{"prompt": "word " * 40, "completion": " yes", "label": True}]
    with pytest.raises(DataError, match="no example's prompt leaves room .* seq_len=8"):
        build_unpaired_datasets(_write(tmp_path / "long.jsonl", long), smol_tokenizer, seq_len=8, batch_size=2)
