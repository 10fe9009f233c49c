"""DPO with zeroth-order training (``--method zo --objective dpo``): MeZO's two perturbed
forwards per sample, each scored with the DPO loss instead of the next-token loss.

The ZO recipe (:mod:`.zo_finetune`) with pairs for data and another head: the block schedule,
the weights in RAM or streamed from NVMe, the (seed, scalar) log that is the checkpoint, and
the export by replay are all ``ZORecipe``'s. DPO's loss is a scalar of the batch, so the head
block turns each perturbation's logits into every row's summed completion log-probability and
those into the DPO loss against the reference's. The reference is the base model's, computed
before the first step by one unperturbed pass of the trainer (streamed from NVMe when the
weights are) and stored as the first-order DPO stores it (``OUTPUT/reference_logps.pt``,
fingerprinted and checksummed); a resumed run, whose weights have moved, reads it back and
stops with one line if it is missing or damaged.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from .._faults import fault_point
from ..events import PreferenceEvalEvent
from ..training.lifecycle import Evaluation
from ..training.loss import dpo_loss
from .preference import REFERENCE_BATCHES, REFERENCE_FILE, read_reference, reference_fingerprint, write_reference
from .zo_finetune import ZORecipe


def row_logps(logits: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    """``[B]``: each row's summed log-probability of its labelled tokens, from fp32 logits
    ``[B, T, V]`` (a ZO head: see ``CausalLMBlocks.head``)."""
    labels = ctx["labels"]
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")  # 0 at -100
    return -nll.sum(dim=1)


class ZODPORecipe(ZORecipe):
    """MeZO / Sparse MeZO on DPO pairs (``method=zo``, ``objective=dpo``)."""

    def _datasets(self) -> tuple[Any, Any]:
        from ..data import build_preference_datasets

        cfg = self.cfg
        return build_preference_datasets(cfg.data, self.tokenizer, cfg.seq_len, seed=cfg.seed,
                                         val_fraction=cfg.val_fraction, max_bytes=cfg.data_max_bytes)

    def _prepare(self) -> None:
        """Attach the reference log-probabilities (stored, or computed now from the base weights
        the trainer holds) and score each step's perturbations with the DPO loss."""
        from ..data import BatchLoader

        cfg, path = self.cfg, self.run.out / REFERENCE_FILE
        fingerprint = reference_fingerprint(cfg, self.train_set, self.val_set)
        stored = read_reference(path, fingerprint, must_exist=bool(cfg.resume))
        if stored is None:
            n = len(self.train_set) + len(self.val_set)
            print(f"outcore: computing the DPO reference log-probabilities of {n} pairs (one forward pass), "
                  f"stored in {path}", file=sys.stderr)
            stored = {"train": self._logps(self.train_set, REFERENCE_BATCHES),
                      "val": self._logps(self.val_set, REFERENCE_BATCHES)}
            if self.run.ranks.is_main:
                write_reference(path, fingerprint, stored)
        self.train_set = self.train_set.with_values("ref_logps", stored["train"])
        self.val_set = self.val_set.with_values("ref_logps", stored["val"])
        position = self.loader.state_dict()  # (a resumed run's loader has moved on already)
        self.loader = BatchLoader(self.train_set, cfg.batch_size, seed=cfg.seed)
        self.loader.load_state_dict(position)
        self.trainer.blocks.head = self._dpo_head

    def _dpo_head(self, logits: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        chosen, rejected = row_logps(logits, ctx).chunk(2)
        ref_chosen, ref_rejected = ctx["batch"]["ref_logps"].to(chosen.device).chunk(2)
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.cfg.beta)[0]

    def _logps(self, dataset: Any, batches: int = 1, max_batches: int = 0) -> torch.Tensor:
        """``[len, 2]`` fp32: the current weights' log-probability of each pair's completions."""
        from ..data import eval_batches

        head, self.trainer.blocks.head = self.trainer.blocks.head, row_logps
        try:
            out = [self.trainer.forward(batch).float().cpu().view(2, -1).t()
                   for batch in eval_batches(dataset, self.cfg.batch_size * batches, max_batches)]
        finally:
            self.trainer.blocks.head = head
        return torch.cat(out) if out else torch.zeros(0, 2)

    def evaluate(self, step: int) -> Evaluation:
        """The held-out DPO loss, preference accuracy and margin (unperturbed forwards)."""
        fault_point("eval")
        cfg = self.cfg
        logps = self._logps(self.val_set, max_batches=cfg.eval_batches)
        ref = self.val_set.values["ref_logps"][:len(logps)]
        if not len(logps):
            return Evaluation(0.0, preference=PreferenceEvalEvent(step=step, n=0, accuracy=0.0, margin=0.0))
        loss, chosen, rejected = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], cfg.beta)
        return Evaluation(float(loss), preference=PreferenceEvalEvent(
            step=step, n=len(logps), accuracy=float((chosen > rejected).float().mean()),
            margin=float((chosen - rejected).mean())))
