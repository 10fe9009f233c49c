"""outcore doctor --model: whether a model's family streams out of core, from its config alone.

The model directories here hold a config.json and nothing else: a check that read a
weight would fail on them.
"""
from __future__ import annotations

import json

import pytest

from outcore.errors import ModelError
from outcore.cli import main

TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def _config_dir(tmp_path, name, config):
    path = tmp_path / name
    config.save_pretrained(path)
    return path


@pytest.fixture
def configs(tmp_path):
    """Config-only directories: a tested family (Mixtral), a multimodal Gemma3 (its vision
    tower cannot stream) and GPT-2 (another layout)."""
    from transformers import Gemma3Config, GPT2Config, MixtralConfig

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    return {
        "mixtral": _config_dir(tmp_path, "mixtral", MixtralConfig(**{**TEXT, "num_local_experts": 4})),
        "gemma3": _config_dir(tmp_path, "gemma3", Gemma3Config(text_config=TEXT, vision_config=vision)),
        "gpt2": _config_dir(tmp_path, "gpt2", GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)),
    }


def _report(tmp_path, capsys, model):
    assert main(["doctor", "--json", "--no-measure", "--swap-dir", str(tmp_path), "--model", str(model)]) == 0
    return json.loads(capsys.readouterr().out)["model"]


def test_a_tested_family_streams(configs, tmp_path, capsys):
    report = _report(tmp_path, capsys, configs["mixtral"])
    assert report["streams"] and report["tested"] and report["family"] == "mixtral"
    assert report["blocks"] == 2 and report["parameters"] > 0
    assert "a tested family: embed, 2 blocks" in report["reason"]
    assert main(["doctor", "--no-measure", "--swap-dir", str(tmp_path), "--model", str(configs["mixtral"])]) == 0
    out = capsys.readouterr().out
    assert "Model" in out and "mixtral (MixtralForCausalLM)" in out and "yes" in out


@pytest.mark.parametrize("name,why", [
    ("gemma3", r"gemma3 \(Gemma3ForConditionalGeneration\) cannot stream out of core: its part "
               r"'model\.vision_tower' \("),
    ("gpt2", r"gpt2 \(GPT2LMHeadModel\) cannot stream out of core: GPT2LMHeadModel has no '\.model' decoder"),
])
def test_a_family_that_cannot_stream_says_why(configs, tmp_path, capsys, name, why):
    import re

    report = _report(tmp_path, capsys, configs[name])
    assert not report["streams"] and not report["tested"]
    assert re.match(why, report["reason"]) and "\n" not in report["reason"]
    assert "--offload none" in report["reason"]  # a tiny model fits in memory


def test_in_memory_advice_only_where_it_fits():
    from transformers import GPT2Config

    from outcore.models import check_streamable, meta_model

    gpt2 = meta_model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ModelError, match="--offload none"):
        check_streamable(gpt2, ram_available=1 << 30)
    with pytest.raises(ModelError, match="does not fit in memory either") as err:
        check_streamable(gpt2, ram_available=1024)
    assert "--offload none" not in str(err.value)


def test_out_of_core_run_is_refused_before_any_work(configs, tmp_path):
    """The recipe refuses a model that cannot stream before reading a weight (there is none)."""
    from outcore.training.config import load_config
    from outcore.recipes.full_finetune import finetune

    data = tmp_path / "data.txt"
    data.write_text("to be or not to be " * 50)
    cfg = load_config(overrides=dict(model=str(configs["gemma3"]), data=str(data), output=str(tmp_path / "run"),
                                     ui="none", offload="nvme", max_steps=1))
    with pytest.raises(ModelError, match=r"^gemma3 \(Gemma3ForConditionalGeneration\) cannot stream out of core: "
                                         r"its part 'model\.vision_tower' \("):
        finetune(cfg)
    assert not (tmp_path / "run" / "swap").exists()
