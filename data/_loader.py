"""An endless, seeded, resumable batch iterator.

The order of epoch *e* is a pure function of ``(seed, e)`` — a fresh
``torch.Generator`` seeded from both — so the loader's whole state is two
integers (epoch, batches taken in it). Saving them in a checkpoint and loading
them back continues with exactly the batches the uninterrupted run would have
seen, which the bit-identical resume of the trainer depends on.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from ..errors import CheckpointError, ConfigError, DataError

_MASK64 = (1 << 64) - 1


def _epoch_seed(seed: int, epoch: int) -> int:
    """Mix (seed, epoch) into one 63-bit generator seed (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _collate(dataset, indices: torch.Tensor) -> dict[str, torch.Tensor]:
    if hasattr(dataset, "get_batch"):  # one gather per tensor instead of B small copies
        return dataset.get_batch(indices)
    items = [dataset[int(i)] for i in indices]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


class BatchLoader:
    """Batches of a dataset, epoch after epoch, in a seeded order that resumes exactly.

    Args:
        dataset: a dataset with ``__len__`` and ``__getitem__`` (returning a dict of
            equal-shape tensors), or a :class:`SequenceDataset` (faster: ``get_batch``).
        batch_size: rows per batch.
        seed: seeds the per-epoch shuffle.
        shuffle: False visits rows in order every epoch.
        drop_last: True skips the last, smaller batch of an epoch (every batch is
            then ``[batch_size, seq_len]``).

    Attributes:
        epoch: the epoch the next batch comes from (0-based).
        position: batches already taken from that epoch.

    Raises:
        ConfigError: ``batch_size`` < 1.
        DataError: the dataset cannot fill a single batch.
    """

    def __init__(self, dataset, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be an integer >= 1")
        n = len(dataset)
        if n == 0 or (drop_last and n < batch_size):
            raise DataError(f"the dataset has {n} sequence(s), fewer than one batch of "
                            f"batch_size={batch_size}; add data, lower seq_len or batch_size")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None  # the current epoch's row order, built lazily
        self._order_epoch = -1

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one pass over the dataset."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            n = len(self.dataset)
            if self.shuffle:
                generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
                self._order = torch.randperm(n, generator=generator)
            else:
                self._order = torch.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch; after the last batch of an epoch the next epoch starts.

        Returns:
            ``{"input_ids", "labels", "attention_mask"}`` (the dataset's keys), each
            ``[batch_size, seq_len]`` (the last batch of an epoch may be smaller when
            ``drop_last`` is False).
        """
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        indices = self._epoch_order()[start:start + self.batch_size]
        self.position += 1
        return _collate(self.dataset, indices)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue from here (plain ints and bools: JSON/torch.save-able)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "num_rows": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; the next batch is the one that would have followed.

        Raises:
            CheckpointError: the state was saved for another dataset size, batch size,
                seed or shuffle setting (resuming would silently change the data order).
        """
        mine = self.state_dict()
        for key in ("num_rows", "batch_size", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != mine[key]:
                raise CheckpointError(
                    f"the checkpoint's data loader had {key}={state[key]!r} but this run has "
                    f"{key}={mine[key]!r}; resume with the same data, seq_len, batch_size and seed")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise CheckpointError(f"data loader state epoch={epoch}, position={position} is out "
                                  f"of range ({self.batches_per_epoch} batches per epoch)")
        self.epoch, self.position = epoch, position


def eval_batches(dataset, batch_size: int, max_batches: int = 0
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """One ordered pass over ``dataset`` (for validation), optionally capped.

    Args:
        dataset: as for :class:`BatchLoader`.
        batch_size: rows per batch (the last one may be smaller).
        max_batches: stop after this many batches (0 = the whole dataset).

    Yields:
        Batches in row order: the same rows every call.

    Raises:
        ConfigError: ``batch_size`` < 1.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be an integer >= 1")
    n = len(dataset)
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches and b >= max_batches:
            return
        yield _collate(dataset, torch.arange(start, min(start + batch_size, n)))
