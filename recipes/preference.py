"""Preference fine-tuning — DPO, ORPO, SimPO (and KTO, :mod:`.kto`) — with full, LoRA or QLoRA,
in memory or out of core.

The full fine-tuning recipe with another loss and other data: everything else (the model in
memory or streamed through the tiers, the trainer, checkpoints, export, the run lifecycle) is
``FullFinetune``'s. A batch of ``B`` pairs is ``2B`` token rows, the chosen completions first;
the loss reads each row's log-probability of its completion from the same per-token NLL the
task scorer uses (out of core the head's chunked loss, never the ``[tokens, vocab]`` logits).

DPO compares with a reference model. It needs no second copy of the model: before the first
step its log-probabilities of every pair are computed in one pass — streamed like an
evaluation, out of core — and stored beside the run (``OUTPUT/reference_logps.pt``, with a
fingerprint of the model, data and length it was computed for, and a checksum), so a resumed
run reads them instead of recomputing them from weights that have moved on. With adapters the
reference is the base with the adapters disabled, so a LoRA run can recompute it at any time.
The pass costs one forward over the data set once (each pair's two rows): one weight read per
batch out of core. ORPO and SimPO have no reference.
"""
from __future__ import annotations

import hashlib
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from .._atomic import write_atomic
from .._faults import fault_point
from ..errors import DataError
from ..events import PreferenceEvalEvent
from ..methods import objective
from ..training.lifecycle import Evaluation, Run
from ..training.loss import dpo_loss, orpo_loss, sequence_logps, simpo_loss
from .full_finetune import FullFinetune

REFERENCE_FILE = "reference_logps.pt"
REFERENCE_BATCHES = 4  # micro-batches per forward of the reference pass


class PreferenceFinetune(FullFinetune):
    """Train on ``{"prompt", "chosen", "rejected"}`` pairs with ``cfg.objective`` (dpo, orpo,
    simpo) and ``cfg.method`` (full, lora, qlora), in memory or out of core.

    Args:
        run: the run it is part of.
    """

    shuffle = True  # the loader's order: KTO's batches are fixed (its KL rows are made within them)

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.objective = self.cfg.objective

    def _datasets(self) -> tuple[Any, Any]:
        from ..data import build_preference_datasets

        cfg = self.cfg
        return build_preference_datasets(cfg.data, self.tokenizer, cfg.seq_len, seed=cfg.seed,
                                         val_fraction=cfg.val_fraction, max_bytes=cfg.data_max_bytes)

    # ------------------------------------------------------------------ the reference
    def _prepare(self) -> None:
        """DPO, KTO: attach the reference log-probabilities of every pair's two rows (read from
        the run's store of them, or computed and stored now)."""
        if not objective(self.objective).reference:
            return
        from ..data import BatchLoader

        path = self.run.out / REFERENCE_FILE
        fingerprint = self._fingerprint()
        stored = read_reference(path, fingerprint, must_exist=bool(self.cfg.resume) and not self.cfg.uses_adapters)
        if stored is None:
            n = len(self.train_set) + len(self.val_set)
            print(f"outcore: computing the {self.objective.upper()} reference log-probabilities of {n} "
                  f"{'examples' if self.objective == 'kto' else 'pairs'} (one forward pass), "
                  f"stored in {path}", file=sys.stderr)
            stored = {"train": self._reference(self.train_set), "val": self._reference(self.val_set)}
            if self.run.ranks.is_main:
                write_reference(path, fingerprint, stored)
        self.train_set = self.train_set.with_values("ref_logps", stored["train"])
        self.val_set = self.val_set.with_values("ref_logps", stored["val"])
        self.loader = BatchLoader(self.train_set, self.cfg.batch_size, seed=self.cfg.seed, shuffle=self.shuffle)

    def _fingerprint(self) -> str:
        return reference_fingerprint(self.cfg, self.train_set, self.val_set)

    @torch.no_grad()
    def _reference(self, dataset: Any) -> torch.Tensor:
        """``[len, 2]`` fp32: the reference's summed log-probability of each pair's completions."""
        from ..data import eval_batches

        self.model.eval()
        frozen = self.model.disable_adapter() if self.cfg.uses_adapters else nullcontext()
        out = []
        with frozen:  # with adapters, the base model is the reference
            # 4 micro-batches at a time: without a backward a block's activations are freed as the
            # next block runs, so 4x the rows stays within what training holds (all blocks'), and
            # out of core each weight read serves 4x the pairs
            for batch in eval_batches(dataset, self.cfg.batch_size * REFERENCE_BATCHES):
                logps = sequence_logps(self.scorer.token_nll(batch), batch["labels"].to(self.run.device))
                out.append(logps.float().cpu().view(2, -1).t())
        self.model.train()
        return torch.cat(out) if out else torch.zeros(0, 2)

    # ------------------------------------------------------------------ train
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The objective's mean loss over the batch's pairs (``model`` is the scorer's)."""
        return self._objective(batch)[0]

    def _objective(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, chosen rewards, rejected rewards)`` of a batch of pairs."""
        cfg, nll = self.cfg, self.scorer.token_nll(batch)
        labels = batch["labels"].to(nll.device)
        if self.objective == "dpo":
            chosen, rejected = sequence_logps(nll, labels).chunk(2)
            ref_chosen, ref_rejected = batch["ref_logps"].to(nll.device).chunk(2)
            return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, cfg.beta)
        chosen, rejected = sequence_logps(nll, labels, average=True).chunk(2)
        if self.objective == "orpo":
            half = labels.shape[0] // 2
            chosen_nll = nll[:half].sum() / (labels[:half, 1:] != -100).sum()  # mean over the chosen tokens
            return orpo_loss(chosen, rejected, chosen_nll, cfg.beta)
        return simpo_loss(chosen, rejected, cfg.beta, cfg.simpo_gamma)

    @torch.no_grad()
    def evaluate(self, step: int) -> Evaluation:
        """The held-out loss, preference accuracy (chosen rewarded above rejected) and margin."""
        from ..data import eval_batches

        self.model.eval()
        fault_point("eval")
        total, pairs, right, margin = 0.0, 0, 0, 0.0
        for batch in eval_batches(self.val_set, self.cfg.batch_size, self.cfg.eval_batches):
            loss, chosen, rejected = self._objective(batch)
            n = chosen.numel()
            total += float(loss) * n
            right += int((chosen > rejected).sum())
            margin += float((chosen - rejected).sum())
            pairs += n
        self.model.train()
        n = max(pairs, 1)
        return Evaluation(total / n, preference=PreferenceEvalEvent(step=step, n=pairs, accuracy=right / n,
                                                                    margin=margin / n))


def reference_fingerprint(cfg: Any, train_set: Any, val_set: Any) -> str:
    """What the reference depends on: the model, its dtype and every pair's tokens."""
    h = hashlib.sha256(f"{cfg.model}|{cfg.dtype}|{cfg.seq_len}".encode())
    for dataset in (train_set, val_set):
        batch = dataset.get_batch(torch.arange(len(dataset)))
        for key in ("input_ids", "labels"):
            h.update(batch[key].to(torch.int32).numpy().tobytes())
    return h.hexdigest()


def _checksum(values: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(values[k].numpy().tobytes() for k in ("train", "val"))).hexdigest()


def read_reference(path: Path, fingerprint: str, must_exist: bool) -> dict[str, torch.Tensor] | None:
    """The stored reference log-probabilities, or None when there are none for this run's model
    and data (they are then computed again).

    Raises:
        DataError: ``must_exist`` (a resumed full fine-tune, whose weights are no longer the
            reference) and the store is missing, unreadable or for other data.
    """
    why = None
    if not path.exists():
        why = "is missing"
    else:
        try:
            stored = torch.load(path, weights_only=True)
            if stored["fingerprint"] != fingerprint:
                why = "was computed for another model, data set or seq_len"
            elif _checksum(stored) != stored["checksum"]:
                why = "is corrupt (its checksum does not match)"
            else:
                return {"train": stored["train"], "val": stored["val"]}
        except Exception as err:  # noqa: BLE001 - any unreadable file is reported the same way
            why = f"cannot be read ({type(err).__name__})"
    if must_exist:
        raise DataError(f"{path} {why}: a resumed full fine-tune cannot recompute its reference from weights "
                        f"that have trained; resume with the run's own model and data, or start a new run")
    return None


def write_reference(path: Path, fingerprint: str, values: dict[str, torch.Tensor]) -> None:
    """Write the store whole or not at all: a crash never leaves half of one."""
    stored = {"fingerprint": fingerprint, "checksum": _checksum(values), **values}
    write_atomic(path, lambda f: torch.save(stored, f), suffix=".pt")
