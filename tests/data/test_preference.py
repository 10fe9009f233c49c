"""Preference pairs: tokenized as TRL's DPOTrainer tokenizes them (plain and conversational
rows), paired rows with loss on the completions only, one-line errors for bad rows."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from outcore.data import build_preference_datasets, encode_pair
from outcore.errors import DataError
from tests.conftest import make_tiny_llama

PLAIN = [{"prompt": "The cat", "chosen": " sat on the mat.", "rejected": " flew away"},
         {"prompt": "Two plus two is", "chosen": " four", "rejected": " five, I think"}]
CHAT = [{"prompt": [{"role": "user", "content": "Capital of France?"}],
         "chosen": [{"role": "assistant", "content": "Paris."}],
         "rejected": [{"role": "assistant", "content": "Lyon, I believe."}]},
        {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],  # implicit prompt
         "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]}]


@pytest.mark.parametrize("rows", [PLAIN, CHAT[:1], CHAT[1:]], ids=["plain", "conversational", "implicit-prompt"])
def test_tokens_equal_trl_dpo_trainer(smol_tokenizer, rows, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = make_tiny_llama(vocab=len(smol_tokenizer))
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_length=64)
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=smol_tokenizer)
    for i, (row, theirs) in enumerate(zip(rows, trainer.train_dataset)):
        assert encode_pair(smol_tokenizer, f"rows:{i}", row) == (
            theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pairs_hold_chosen_then_rejected_with_loss_on_completions(smol_tokenizer, tmp_path):
    data = _write(tmp_path / "pairs.jsonl", PLAIN * 5)
    train, val = build_preference_datasets(data, smol_tokenizer, seq_len=16, val_fraction=0.2)
    assert len(train) == 8 and len(val) == 2
    ref = torch.arange(16, dtype=torch.float32).view(8, 2)
    batch = train.with_values("ref_logps", ref).get_batch([0, 3])
    assert batch["input_ids"].shape == (4, 16) and batch["ref_logps"].tolist() == [0.0, 6.0, 1.0, 7.0]
    prompt, chosen, rejected = encode_pair(smol_tokenizer, "x", PLAIN[train.chosen.index[0] % 2])
    labels = batch["labels"]
    assert labels[0, :len(prompt)].eq(-100).all()
    assert labels[0, len(prompt):len(prompt) + len(chosen)].tolist() == chosen
    assert labels[2, len(prompt):len(prompt) + len(rejected)].tolist() == rejected


@pytest.mark.parametrize("row,message", [
    ({"prompt": "a", "chosen": "b"}, "rows need 'chosen' and 'rejected'"),
    ({"prompt": "a", "chosen": "b", "rejected": ""}, "'rejected' is empty"),
    ({"chosen": "b", "rejected": "c"}, "need a 'prompt' field"),
    ({"prompt": "a", "chosen": "b", "rejected": 3}, "'rejected' must be a string"),
])
def test_bad_rows_name_file_line_and_field(smol_tokenizer, tmp_path, row, message):
    data = _write(tmp_path / "pairs.jsonl", [PLAIN[0], row])
    with pytest.raises(DataError, match=rf"pairs.jsonl:2: .*{message}"):
        build_preference_datasets(data, smol_tokenizer, seq_len=16)


def test_text_data_empty_files_and_prompts_filling_seq_len_are_refused(smol_tokenizer, tmp_path):
    with pytest.raises(DataError, match="read JSONL rows with 'prompt', 'chosen' and 'rejected'"):
        build_preference_datasets(_write(tmp_path / "a.txt", []), smol_tokenizer, seq_len=16)
    with pytest.raises(DataError, match="empty.jsonl' has no rows; add JSONL rows with 'prompt'"):
        build_preference_datasets(_write(tmp_path / "empty.jsonl", []), smol_tokenizer, seq_len=16)
    long = [{"prompt": "word " * 40, "chosen": " yes", "rejected": " no"}]
    with pytest.raises(DataError, match="no pair's prompt leaves room .* seq_len=8"):
        build_preference_datasets(_write(tmp_path / "long.jsonl", long), smol_tokenizer, seq_len=8)
