"""The config's first-run settings: the embedded default trains write-lean unless told otherwise."""
from __future__ import annotations

import pytest

from outcore.training.config import FIRST_RUN, FinetuneConfig, load_config


def test_the_embedded_default_trains_write_lean():
    cfg = load_config()
    assert (cfg.precision, cfg.optim, cfg.dtype) == ("bf16-lean", "adamw8bit", "bfloat16")
    assert cfg == FinetuneConfig(**FIRST_RUN)
    assert FinetuneConfig().precision == "exact"  # the library's own default stays exact fp32 AdamW


@pytest.mark.parametrize("given", [
    {"precision": "exact"},  # exactness is one flag away
    {"optim": "adamw"},
    {"dtype": "float32"},
    {"method": "lora"},
    {"objective": "dpo"},
    {"model": "./my-llama"},
    {"data": "notes.txt"},
])
def test_any_choice_of_the_user_keeps_the_exact_defaults(given):
    cfg = load_config(overrides=given)
    assert cfg.precision == "exact" and cfg.dtype == "float32"
    assert cfg.optim == given.get("optim", "adamw")


def test_a_yaml_file_setting_precision_is_honoured(tmp_path):
    (tmp_path / "run.yaml").write_text("precision: exact\nmax_steps: 3\n")
    assert load_config(tmp_path / "run.yaml").precision == "exact"
    (tmp_path / "lean.yaml").write_text("max_steps: 3\n")
    assert load_config(tmp_path / "lean.yaml").precision == "bf16-lean"
