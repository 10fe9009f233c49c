"""The TRL example (recipes/examples/trl_sft.py) runs out of core on the embedded default."""
from __future__ import annotations

import math

import pytest
import torch


@pytest.mark.slow(ci=True)  # SmolLM2-135M on the CPU: ~1 min a step on a loaded 2-core box
def test_trl_sft_example_trains_the_default_model_out_of_core(tmp_path):
    from transformers import AutoModelForCausalLM

    from outcore.models import load_model
    from outcore.recipes.examples import trl_sft

    trainer = trl_sft.main(["--steps", "1", "--max-length", "64", "--output", str(tmp_path)])
    assert type(trainer).__name__ == "OutOfCoreSFTTrainer" and trainer.engine is not None
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(log["loss"]) and log["grad_norm"] > 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path)
    base, _ = load_model("default", tokenizer=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    changed = dict(trained.named_parameters())[name] - dict(base.named_parameters())[name]
    assert changed.abs().max() > 0  # one AdamW step at lr 1e-4 moved the weights
    assert torch.isfinite(changed).all()
