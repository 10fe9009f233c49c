"""The seeded validation split, argument checks, and check_seq_len."""
from __future__ import annotations

import pytest
import torch

from outcore.data import SequenceDataset, build_datasets, check_seq_len, split_rows
from outcore.errors import ConfigError, DataError


@pytest.mark.parametrize("n, frac", [(100, 0.02), (100, 0.5), (7, 0.1), (2, 0.02)])
def test_split_is_disjoint_complete_and_seeded(n, frac):
    train, val = split_rows(n, frac, seed=3, label="x", seq_len=8)
    assert len(val) == max(1, round(n * frac))
    assert sorted(train.tolist() + val.tolist()) == list(range(n))
    again_train, again_val = split_rows(n, frac, seed=3, label="x", seq_len=8)
    assert torch.equal(train, again_train) and torch.equal(val, again_val)


def test_split_depends_on_seed():
    vals = {tuple(split_rows(1000, 0.05, seed=s, label="x", seq_len=8)[1].tolist())
            for s in range(4)}
    assert len(vals) == 4


def test_zero_val_fraction_keeps_everything_for_training():
    train, val = split_rows(5, 0.0, seed=0, label="x", seq_len=8)
    assert train.tolist() == [0, 1, 2, 3, 4] and val.numel() == 0


def test_too_few_rows_for_a_validation_split():
    with pytest.raises(DataError, match=r"only 1 sequence\(s\) of seq_len=8: too few to hold out a "
                                        r"validation split; add data, lower seq_len, or set "
                                        r"val_fraction=0"):
        split_rows(1, 0.02, seed=0, label="x", seq_len=8)


def test_build_datasets_split_never_overlaps(tok, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(f"Line {i}: to be or not to be.\n" for i in range(300)))
    train, val = build_datasets(str(f), tok, 8, seed=1, val_fraction=0.1, use_cache=False)
    assert set(train.index.tolist()).isdisjoint(val.index.tolist())
    assert len(val) == round(0.1 * (len(train) + len(val)))
    train2, val2 = build_datasets(str(f), tok, 8, seed=1, val_fraction=0.1, use_cache=False)
    assert torch.equal(val.index, val2.index)
    _, val3 = build_datasets(str(f), tok, 8, seed=2, val_fraction=0.1, use_cache=False)
    assert not torch.equal(val.index, val3.index)


def test_one_row_of_text_cannot_be_split(tok, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("To be, or not to be, that is the question.")
    n_tokens = len(tok(f.read_text())["input_ids"]) + 1
    with pytest.raises(DataError, match=r"set val_fraction=0"):
        build_datasets(str(f), tok, n_tokens, use_cache=False)
    train, val = build_datasets(str(f), tok, n_tokens, val_fraction=0, use_cache=False)
    assert len(train) == 1 and len(val) == 0


@pytest.mark.parametrize("kwargs, pattern", [
    ({"seq_len": 1}, r"seq_len=1 must be an integer >= 2"),
    ({"seq_len": 8.0}, r"seq_len=8.0 must be an integer"),
    ({"seq_len": 8, "val_fraction": 1.0}, r"val_fraction=1.0 must be in \[0, 1\)"),
    ({"seq_len": 8, "val_fraction": -0.1}, r"val_fraction=-0.1"),
    ({"seq_len": 8, "max_bytes": -1}, r"max_bytes=-1 must be an integer >= 0"),
])
def test_bad_arguments(tok, kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_datasets("default", tok, **kwargs)


def test_check_seq_len(tiny_llama):
    assert check_seq_len(tiny_llama, 512) == 512
    with pytest.raises(ConfigError, match=r"seq_len=513 is longer than the model allows "
                                          r"\(max_position_embeddings=512 for llama\); use "
                                          r"seq_len <= 512"):
        check_seq_len(tiny_llama, 513)
    for bad in (0, 1, True, "8"):
        with pytest.raises(ConfigError, match=r"must be an integer >= 2"):
            check_seq_len(tiny_llama, bad)


def test_dataset_indexing():
    ids = torch.arange(12, dtype=torch.int32).view(4, 3)
    ds = SequenceDataset(ids, index=torch.tensor([3, 1]))
    assert len(ds) == 2 and ds.seq_len == 3 and ds.num_tokens == 6
    assert ds[0]["input_ids"].tolist() == [9, 10, 11] and ds[-1]["input_ids"].tolist() == [3, 4, 5]
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(IndexError):
        ds.get_batch([0, 5])
    assert [r["input_ids"][0].item() for r in ds] == [9, 3]  # iteration protocol stops
    with pytest.raises(ValueError, match="labels has shape"):
        SequenceDataset(ids, labels=torch.zeros(4, 2))
