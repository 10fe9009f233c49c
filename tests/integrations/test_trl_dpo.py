"""TRL's DPOTrainer out of core: ``out_of_core(DPOTrainer)`` with the reference's
log-probabilities precomputed (TRL's ``precompute_ref_log_probs``, so no second model is held)
gives the in-memory DPOTrainer's losses, rewards and weights, bit for bit (fp32)."""
from __future__ import annotations

import pytest
import torch

from tests._helpers import exported_weights
from tests.conftest import make_tiny_llama

trl = pytest.importorskip("trl")
ROWS = [{"prompt": "The cat", "chosen": " sat on the mat.", "rejected": " flew away quickly"},
        {"prompt": "Two plus two is", "chosen": " four", "rejected": " five, I think"}] * 4


def _train(cls, out, tok, **kw):
    from datasets import Dataset
    from trl import DPOConfig

    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=2, report_to=[], beta=0.1, max_length=64,
                     use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-3, precompute_ref_log_probs=True,
                     logging_steps=1, save_strategy="no", seed=0, gradient_checkpointing=False, disable_tqdm=True)
    trainer = cls(model=make_tiny_llama(vocab=len(tok)).train(), args=args, train_dataset=Dataset.from_list(ROWS),
                  processing_class=tok, **kw)
    trainer.train()
    trainer.save_model(str(out / "final"))
    logged = [(h["loss"], h["rewards/margins"]) for h in trainer.state.log_history if "loss" in h]
    return trainer, logged, exported_weights(out / "final")


def test_out_of_core_dpo_trainer_equals_in_memory(tmp_path):
    from trl import DPOTrainer

    from outcore.integrations import out_of_core
    from outcore.models import load_tokenizer

    tok = load_tokenizer("default")
    _, want_log, want = _train(DPOTrainer, tmp_path / "mem", tok)
    ooc, got_log, got = _train(out_of_core(DPOTrainer), tmp_path / "ooc", tok, offload="nvme",
                               swap_dir=str(tmp_path / "swap"))
    try:
        assert type(ooc).__name__ == "OutOfCoreDPOTrainer" and ooc.engine is not None
        assert ooc.engine.store.tier_stats()["NVME"].read_bytes > 0
    finally:
        ooc.close()
    assert got_log == want_log and len(want_log) == 3 and want_log[-1][1] > 0  # the policy moved off the reference
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
