"""KTO fine-tuning on unpaired preference data, with full, LoRA or QLoRA, in memory or out of core.

The preference recipe with unpaired examples (:mod:`outcore.data._unpaired`): a batch of
``B`` examples is ``2B`` token rows, each example's completion first, then its mismatched
``KL`` row (the prompt with another example's completion). Both halves ride one forward (out
of core: one weight read per micro-batch); the KL half's gradient is zero, as the estimate is
detached, so it costs compute and activations, not a second pass. The reference is DPO's: the
log-probabilities of both rows of every example, computed once before training and stored
(``OUTPUT/reference_logps.pt``, fingerprinted over both rows' tokens, so another batch size,
which makes other KL rows, computes them anew), or with adapters the base with them disabled.

The loader visits the examples in order (TRL's sequential sampler): a batch's KL rows are its
own completions rotated, and the batches are the same in memory, out of core and on resume.
"""
from __future__ import annotations

from typing import Any

import torch

from .._faults import fault_point
from ..events import PreferenceEvalEvent
from ..training.lifecycle import Evaluation
from ..training.loss import kto_loss, sequence_logps
from .preference import PreferenceFinetune


class KTOFinetune(PreferenceFinetune):
    """Train on ``{"prompt", "completion", "label"}`` examples (or pairs, unpaired) with KTO."""

    shuffle = False

    def _datasets(self) -> tuple[Any, Any]:
        from ..data import build_unpaired_datasets

        cfg = self.cfg
        return build_unpaired_datasets(cfg.data, self.tokenizer, cfg.seq_len, cfg.batch_size, seed=cfg.seed,
                                       val_fraction=cfg.val_fraction, max_bytes=cfg.data_max_bytes)

    def _objective(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, rewards [B], KL estimate)`` of a batch of examples."""
        cfg, nll = self.cfg, self.scorer.token_nll(batch)
        logps, kl_logps = sequence_logps(nll, batch["labels"].to(nll.device)).chunk(2)
        ref, ref_kl = batch["ref_logps"].to(nll.device).chunk(2)
        return kto_loss(logps, ref, kl_logps, ref_kl, batch["desirable"], cfg.beta, cfg.desirable_weight,
                        cfg.undesirable_weight)

    @torch.no_grad()
    def evaluate(self, step: int) -> Evaluation:
        """The held-out loss; the share of examples whose reward has their label's sign; the
        desirable examples' mean reward minus the undesirable ones'; the mean KL estimate."""
        from ..data import eval_batches

        self.model.eval()
        fault_point("eval")
        total, n, right, kl, batches = 0.0, 0, 0, 0.0, 0
        sums, counts = [0.0, 0.0], [0, 0]  # rewards of the undesirable, the desirable examples
        # in order, batch_size at a time: the runs the KL rows were made in
        for batch in eval_batches(self.val_set, self.cfg.batch_size, self.cfg.eval_batches):
            loss, rewards, batch_kl = self._objective(batch)
            desirable = batch["desirable"].to(rewards.device)
            total += float(loss) * rewards.numel()
            right += int(torch.where(desirable, rewards > 0, rewards < 0).sum())  # a reward of 0 is never right
            for label in (0, 1):
                chosen = rewards[desirable == bool(label)]
                sums[label] += float(chosen.sum())
                counts[label] += chosen.numel()
            kl += float(batch_kl)
            n, batches = n + rewards.numel(), batches + 1
        self.model.train()
        means = [s / c if c else 0.0 for s, c in zip(sums, counts)]
        return Evaluation(total / max(n, 1), preference=PreferenceEvalEvent(
            step=step, n=n, accuracy=right / max(n, 1), margin=means[1] - means[0], kl=kl / max(batches, 1)))
