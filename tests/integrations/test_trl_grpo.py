"""TRL's GRPOTrainer out of core: ``out_of_core(GRPOTrainer)`` samples its completions with
``model.generate`` through the streamed weights and scores them with TRL's fused log-probabilities
(which read ``lm_head.weight`` without calling ``lm_head``); it gives the in-memory GRPOTrainer's
completions, losses, rewards, gradient norms and weights, bit for bit (fp32, CPU): a full
fine-tune, and LoRA with the KL term (its reference: the streamed base, adapters disabled)."""
from __future__ import annotations

import pytest
import torch

from tests._helpers import exported_weights
from tests.conftest import make_tiny_llama

trl = pytest.importorskip("trl")
PROMPTS = [{"prompt": p} for p in ("The cat", "Two plus two is", "Once upon a time", "Hello")] * 2
LOGGED = ("loss", "reward", "reward_std", "entropy", "grad_norm")


def _train(cls, out, tok, lora: bool, **kw):
    from datasets import Dataset
    from trl import GRPOConfig

    sampled = []

    def even_tokens(completion_ids, **_):  # deterministic: how many sampled ids are even
        sampled.append([list(c) for c in completion_ids])
        return [float(sum(t % 2 == 0 for t in c)) for c in completion_ids]

    if lora:
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                       task_type="CAUSAL_LM")
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      report_to=[], use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-2, logging_steps=1,
                      save_strategy="no", seed=0, gradient_checkpointing=False, disable_tqdm=True,
                      beta=0.04 if lora else 0.0)
    trainer = cls(model=make_tiny_llama(vocab=len(tok)).train(), reward_funcs=even_tokens, args=args,
                  train_dataset=Dataset.from_list(PROMPTS), processing_class=tok, **kw)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    trainer.save_model(str(out / "final"))
    moved = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    logged = [tuple(h[k] for k in LOGGED) for h in trainer.state.log_history if "loss" in h]
    return trainer, sampled, logged, exported_weights(out / "final"), moved


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-kl"])
def test_out_of_core_grpo_trainer_equals_in_memory(tmp_path, lora):
    from trl import GRPOTrainer

    from outcore.integrations import out_of_core
    from outcore.models import load_tokenizer

    if lora:
        pytest.importorskip("peft")
    tok = load_tokenizer("default")
    _, want_sampled, want_log, want, moved = _train(GRPOTrainer, tmp_path / "mem", tok, lora)
    ooc, got_sampled, got_log, got, _ = _train(out_of_core(GRPOTrainer), tmp_path / "ooc", tok, lora,
                                               offload="nvme", swap_dir=str(tmp_path / "swap"))
    try:
        assert type(ooc).__name__ == "OutOfCoreGRPOTrainer" and ooc.engine is not None
        assert ooc.engine.store.tier_stats()["NVME"].read_bytes > 0
        # TRL's fused log-probabilities read the head's weight directly: the head unit (and the
        # embedding it is tied to) still leaves memory when the model returns
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            ooc._get_per_token_logps_and_entropies(ooc.model, ids, torch.ones_like(ids), 3)
        assert [u.name for u in ooc.engine.units if u.step.bound is not None] == []
    finally:
        ooc.close()
    assert got_sampled == want_sampled and len(want_sampled) == 3
    assert got_log == want_log and len(want_log) == 3 and any(h[2] > 0 for h in want_log)  # rewards differed
    assert moved  # the in-memory policy trained
    assert want.keys() == got.keys() and want
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_vllm_generation_is_refused_in_one_line(tmp_path):
    from trl import GRPOConfig

    from outcore.errors import ConfigError
    from outcore.integrations.trainer_args import check_training_args

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, use_cpu=True, bf16=False, report_to=[],
                      gradient_checkpointing=False)
    with pytest.raises(ConfigError, match="use_vllm=True") as err:
        check_training_args(args)
    assert "\n" not in str(err.value)
    check_training_args(GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                                   gradient_checkpointing=False))  # transformers' generate: accepted
