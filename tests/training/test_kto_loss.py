"""KTO equals TRL's ``KTOTrainer`` on the same tiny model and batch (fp32, within 1e-6): the
loss through ``KTOTrainer.compute_loss`` itself, with a reference model and a KL estimate
above 0, and the token rows (completions and mismatched KL rows) our data gives."""
from __future__ import annotations

import json

import pytest
import torch

from outcore.training.loss import CausalLMScorer, kto_loss, sequence_logps
from tests._helpers import policy_and_reference

trl = pytest.importorskip("trl")
ROWS = [{"prompt": "The cat", "completion": " sat on the mat.", "label": True},
        {"prompt": "Two plus two is", "completion": " five, I think", "label": False},
        {"prompt": "Paris is in", "completion": " France.", "label": True},
        {"prompt": "The sky is", "completion": " green and very loud", "label": False}]


@pytest.fixture(scope="module")
def tok():
    from outcore.models import load_tokenizer

    return load_tokenizer("default")


def _trainer(tok, tmp_path, policy, ref, rows):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to=[], beta=0.5,
                     desirable_weight=1.3, undesirable_weight=0.7, max_length=64, use_cpu=True, bf16=False)
    return KTOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=tok)


def _logps(model, ids, mask, completion_mask):
    labels = ids.masked_fill(completion_mask == 0, -100)
    rows = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return sequence_logps(CausalLMScorer(model).token_nll(rows), labels)


def test_kto_equals_trl_kto_trainer(tok, tmp_path):
    policy, ref = policy_and_reference(len(tok))
    trainer = _trainer(tok, tmp_path, policy, ref, ROWS)
    batch = next(iter(trainer.get_train_dataloader()))
    theirs = trainer.compute_loss(trainer.model, batch)
    their_kl = trainer._metrics["eval"]["kl"][-1]

    main = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    kl_rows = (batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
    logps, kl_logps = _logps(policy, *main), _logps(policy, *kl_rows)
    with torch.no_grad():
        ref_logps, ref_kl = _logps(ref, *main), _logps(ref, *kl_rows)
    ours, rewards, kl = kto_loss(logps, ref_logps, kl_logps, ref_kl, batch["label"], beta=0.5,
                                 desirable_weight=1.3, undesirable_weight=0.7)
    assert float(kl) > 0.01 and abs(float(kl) - their_kl) < 1e-6  # the KL term is in play
    assert abs(float(theirs) - float(ours)) < 1e-6
    assert not rewards.requires_grad and rewards.shape == (4,)
    ours.backward()  # the KL rows carry no gradient: the estimate is detached
    assert kl_logps.grad_fn is not None and not kl.requires_grad


def test_kto_clamps_a_negative_kl_estimate_at_zero():
    logps, ref = torch.tensor([-3.0, -4.0]), torch.tensor([-3.5, -3.0])
    loss, _, kl = kto_loss(logps, ref, torch.tensor([-9.0, -9.0]), torch.tensor([-1.0, -1.0]),
                           torch.tensor([True, False]), beta=1.0)
    by_hand = ((1 - torch.sigmoid(torch.tensor(0.5))) + (1 - torch.sigmoid(torch.tensor(1.0)))) / 2
    assert float(kl) == 0.0 and abs(float(loss) - float(by_hand)) < 1e-7


@pytest.mark.parametrize("paired", [False, True])
def test_our_rows_are_trls_rows(tok, tmp_path, paired):
    """The completion and KL rows of our data == TRL's batch (paired rows unpaired as TRL does)."""
    from outcore.data import build_unpaired_datasets

    rows = ROWS if not paired else [{"prompt": "The cat", "chosen": " sat.", "rejected": " flew off"},
                                    {"prompt": "One and one", "chosen": " make two", "rejected": " make three"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = build_unpaired_datasets(path, tok, seq_len=64, batch_size=4, val_fraction=0.0)
    policy, ref = policy_and_reference(len(tok))
    batch = next(iter(_trainer(tok, tmp_path, policy, ref, rows).get_train_dataloader()))
    ours = train.get_batch(torch.arange(4))
    assert torch.equal(ours["desirable"], batch["label"])
    for half, prefix in ((slice(0, 4), ""), (slice(4, 8), "KL_")):
        width = batch[f"{prefix}input_ids"].shape[1]
        mask = batch[f"{prefix}attention_mask"].bool()
        assert torch.equal(ours["input_ids"][half, :width][mask], batch[f"{prefix}input_ids"][mask])
        labels = batch[f"{prefix}input_ids"].masked_fill(batch[f"{prefix}completion_mask"] == 0, -100)
        assert torch.equal(ours["labels"][half, :width], labels)
