"""The preference losses equal TRL's on the same tiny model and batch (fp32, within 1e-6):
DPO through ``DPOTrainer.compute_loss`` itself, ORPO and SimPO through TRL's own functions
for the sequence log-probabilities and the losses."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from outcore.training.loss import CausalLMScorer, dpo_loss, orpo_loss, sequence_logps, simpo_loss
from tests._helpers import policy_and_reference

trl = pytest.importorskip("trl")
ROWS = [{"prompt": "The cat", "chosen": " sat on the mat.", "rejected": " flew away quickly over the hills"},
        {"prompt": "Two plus two is", "chosen": " four", "rejected": " five, I think"},
        {"prompt": "Paris is in", "chosen": " France.", "rejected": " Spain"}]


@pytest.fixture(scope="module")
def tok():
    from outcore.models import load_tokenizer

    return load_tokenizer("default")


def _ours(model, batch):
    """``[2B, T]`` per-token NLL and labels of a TRL batch (``completion_mask`` → labels)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    rows = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}
    return CausalLMScorer(model).token_nll(rows), labels


def test_dpo_equals_trl_dpo_trainer(tok, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy, ref = policy_and_reference(len(tok))
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, report_to=[], beta=0.1,
                     max_length=64, use_cpu=True, bf16=False)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(ROWS),
                         processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    theirs = trainer.compute_loss(trainer.model, batch)

    nll, labels = _ours(policy, batch)
    with torch.no_grad():
        ref_nll, _ = _ours(ref, batch)
    chosen, rejected = sequence_logps(nll, labels).chunk(2)
    ref_chosen, ref_rejected = sequence_logps(ref_nll, labels).chunk(2)
    ours, chosen_reward, rejected_reward = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    assert abs(float(theirs) - float(ours)) < 1e-6 and abs(float(ours) - 0.6931) > 1e-3
    assert not chosen_reward.requires_grad and chosen_reward.shape == (3,)


def _trl_logps(cls, model, batch, average: bool):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return logits, labels, cls.get_batch_logps(logits, labels, average_log_prob=average)


def _batch(tok):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from outcore.data import encode_pair

    pairs = [encode_pair(tok, f"rows:{i}", row) for i, row in enumerate(ROWS)]
    collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
    return collate([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs])


def test_orpo_equals_trl(tok):
    from trl.experimental.orpo import ORPOTrainer

    policy, _ = policy_and_reference(len(tok))
    batch = _batch(tok)
    logits, labels, logps = _trl_logps(ORPOTrainer, policy, batch, average=True)
    half = labels.shape[0] // 2
    nll = F.cross_entropy(logits[:half, :-1].flatten(0, 1), labels[:half, 1:].flatten())
    this = SimpleNamespace(beta=0.1, accelerator=SimpleNamespace(device="cpu"))
    ratio = ORPOTrainer.odds_ratio_loss(this, *logps.chunk(2))[0]
    theirs = nll - ratio.mean()

    token_nll, labels = _ours(policy, batch)
    chosen, rejected = sequence_logps(token_nll, labels, average=True).chunk(2)
    chosen_nll = token_nll[:half].sum() / (labels[:half, 1:] != -100).sum()
    ours = orpo_loss(chosen, rejected, chosen_nll, beta=0.1)[0]
    assert abs(float(theirs) - float(ours)) < 1e-6


def test_simpo_equals_trl_cpo_simpo(tok):
    from trl.experimental.cpo import CPOTrainer

    policy, _ = policy_and_reference(len(tok))
    batch = _batch(tok)
    _, _, logps = _trl_logps(CPOTrainer, policy, batch, average=True)
    this = SimpleNamespace(beta=2.0, simpo_gamma=0.5, alpha=0.0, loss_type="simpo", label_smoothing=0.0,
                           accelerator=SimpleNamespace(device="cpu"))
    theirs = CPOTrainer.cpo_loss(this, *logps.chunk(2))[0].mean()

    token_nll, labels = _ours(policy, batch)
    ours = simpo_loss(*sequence_logps(token_nll, labels, average=True).chunk(2), beta=2.0, gamma=0.5)[0]
    assert abs(float(theirs) - float(ours)) < 1e-6
