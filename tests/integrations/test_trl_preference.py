"""TRL's DPOTrainer and KTOTrainer out of core: ``out_of_core(DPOTrainer | KTOTrainer)`` with the
reference's log-probabilities precomputed (TRL's ``precompute_ref_log_probs``: KTO's for the
completions and the KL rows, so no second model is held) gives the in-memory trainer's losses,
reward margins (DPO) or KL estimates (KTO) and weights, bit for bit (fp32)."""
from __future__ import annotations

import pytest
import torch

from tests._helpers import exported_weights
from tests.conftest import make_tiny_llama

trl = pytest.importorskip("trl")
PAIRS = [{"prompt": "The cat", "chosen": " sat on the mat.", "rejected": " flew away quickly"},
         {"prompt": "Two plus two is", "chosen": " four", "rejected": " five, I think"}] * 4
UNPAIRED = [{"prompt": "The cat", "completion": " sat on the mat.", "label": True},
            {"prompt": "Two plus two is", "completion": " five, I think", "label": False},
            {"prompt": "Paris is in", "completion": " France.", "label": True},
            {"prompt": "The sky is", "completion": " green and loud", "label": False}] * 2
# trainer name -> (its data, the logged figure that shows the preference term in play: DPO's policy
# moved off the reference, KTO's KL estimate)
CASES = {"DPO": (PAIRS, "rewards/margins"), "KTO": (UNPAIRED, "kl")}


def _train(name, cls, out, tok, **kw):
    from datasets import Dataset

    rows, figure = CASES[name]
    args = getattr(trl, f"{name}Config")(
        output_dir=str(out), per_device_train_batch_size=2, report_to=[], beta=0.1, max_length=64, use_cpu=True,
        bf16=False, max_steps=3, learning_rate=1e-3, precompute_ref_log_probs=True, logging_steps=1,
        save_strategy="no", seed=0, gradient_checkpointing=False, disable_tqdm=True)
    trainer = cls(model=make_tiny_llama(vocab=len(tok)).train(), args=args, train_dataset=Dataset.from_list(rows),
                  processing_class=tok, **kw)
    trainer.train()
    trainer.save_model(str(out / "final"))
    logged = [(h["loss"], h[figure]) for h in trainer.state.log_history if "loss" in h]
    return trainer, logged, exported_weights(out / "final")


@pytest.mark.parametrize("name", list(CASES))
def test_out_of_core_preference_trainer_equals_in_memory(tmp_path, name):
    from outcore.integrations import out_of_core
    from outcore.models import load_tokenizer

    tok = load_tokenizer("default")
    trainer = getattr(trl, f"{name}Trainer")
    _, want_log, want = _train(name, trainer, tmp_path / "mem", tok)
    ooc, got_log, got = _train(name, out_of_core(trainer), tmp_path / "ooc", tok, offload="nvme",
                               swap_dir=str(tmp_path / "swap"))
    try:
        assert type(ooc).__name__ == f"OutOfCore{name}Trainer" and ooc.engine is not None
        assert ooc.engine.store.tier_stats()["NVME"].read_bytes > 0
    finally:
        ooc.close()
    assert got_log == want_log and len(want_log) == 3 and want_log[-1][1] > 0  # the preference term in play
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
