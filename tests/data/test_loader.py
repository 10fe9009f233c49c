"""BatchLoader: seeded order, epochs, exact resume; eval_batches."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outcore.data import BatchLoader, SequenceDataset, eval_batches
from outcore.errors import CheckpointError, ConfigError, DataError


def _ds(n=10, seq_len=4):
    return SequenceDataset(torch.arange(n * seq_len, dtype=torch.int32).view(n, seq_len))


def _rows(batch, seq_len=4):
    return (batch["input_ids"][:, 0] // seq_len).tolist()


def test_batches_have_the_right_shape_and_keys():
    batch = BatchLoader(_ds(), 3, seed=0).next_batch()
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(v.shape == (3, 4) and v.dtype == torch.int64 for v in batch.values())


def test_each_epoch_visits_every_row_once_in_a_new_order():
    loader = BatchLoader(_ds(10), 5, seed=0, drop_last=False)
    epochs = [[r for _ in range(2) for r in _rows(loader.next_batch())] for _ in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] and loader.epoch == 2 and loader.position == 2


def test_drop_last_and_partial_last_batch():
    drop = BatchLoader(_ds(10), 4, seed=0)
    keep = BatchLoader(_ds(10), 4, seed=0, drop_last=False)
    assert drop.batches_per_epoch == 2 and keep.batches_per_epoch == 3
    sizes = [keep.next_batch()["input_ids"].shape[0] for _ in range(3)]
    assert sizes == [4, 4, 2]
    for _ in range(3):
        drop.next_batch()
    assert drop.epoch == 1 and drop.position == 1


def test_same_seed_same_order_other_seed_other_order():
    def order(seed):
        loader = BatchLoader(_ds(10), 2, seed=seed)
        return [_rows(loader.next_batch()) for _ in range(10)]
    assert order(7) == order(7) and order(7) != order(8)


def test_no_shuffle_is_sequential():
    loader = BatchLoader(_ds(6), 2, seed=0, shuffle=False)
    assert [_rows(loader.next_batch()) for _ in range(4)] == [[0, 1], [2, 3], [4, 5], [0, 1]]


@settings(max_examples=25, deadline=None)
@given(k=st.integers(0, 25), batch_size=st.integers(1, 4), drop_last=st.booleans(),
       seed=st.integers(0, 2**31))
def test_resume_continues_bit_identically(k, batch_size, drop_last, seed):
    ds = _ds(9)
    straight = BatchLoader(ds, batch_size, seed=seed, drop_last=drop_last)
    expected = [straight.next_batch() for _ in range(k + 6)][k:]
    first = BatchLoader(ds, batch_size, seed=seed, drop_last=drop_last)
    for _ in range(k):
        first.next_batch()
    state = first.state_dict()
    resumed = BatchLoader(ds, batch_size, seed=seed, drop_last=drop_last)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        assert all(torch.equal(got[key], want[key]) for key in want)


def test_state_is_plain_python():
    state = BatchLoader(_ds(), 2, seed=1).state_dict()
    assert all(isinstance(v, (int, bool)) for v in state.values())


@pytest.mark.parametrize("change", [{"seed": 2}, {"batch_size": 3}, {"num_rows": 11},
                                    {"shuffle": False}])
def test_resume_into_another_setup_is_refused(change):
    state = {**BatchLoader(_ds(), 2, seed=1).state_dict(), **change}
    key, value = next(iter(change.items()))
    with pytest.raises(CheckpointError, match=rf"checkpoint's data loader had {key}={value!r}"):
        BatchLoader(_ds(), 2, seed=1).load_state_dict(state)


def test_out_of_range_state_is_refused():
    loader = BatchLoader(_ds(), 2, seed=1)
    with pytest.raises(CheckpointError, match=r"position=9 is out of range"):
        loader.load_state_dict({**loader.state_dict(), "position": 9})


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_batch_size(bad):
    with pytest.raises(ConfigError, match=rf"batch_size={bad!r} must be an integer >= 1"):
        BatchLoader(_ds(), bad, seed=0)


def test_dataset_smaller_than_one_batch():
    with pytest.raises(DataError, match=r"has 3 sequence\(s\), fewer than one batch of "
                                        r"batch_size=4; add data, lower seq_len or batch_size"):
        BatchLoader(_ds(3), 4, seed=0)
    assert BatchLoader(_ds(3), 4, seed=0, drop_last=False).next_batch()["input_ids"].shape == (3, 4)


def test_plain_datasets_are_stacked():
    data = [{"input_ids": torch.full((3,), i), "labels": torch.full((3,), i)} for i in range(4)]
    batch = BatchLoader(data, 2, seed=0, shuffle=False).next_batch()
    assert batch["input_ids"].tolist() == [[0, 0, 0], [1, 1, 1]]


def test_eval_batches_are_ordered_and_capped():
    ds = _ds(5)
    assert [_rows(b) for b in eval_batches(ds, 2)] == [[0, 1], [2, 3], [4]]
    assert [_rows(b) for b in eval_batches(ds, 2, max_batches=2)] == [[0, 1], [2, 3]]
    assert list(eval_batches(_ds(0), 2)) == []
