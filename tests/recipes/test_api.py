"""``outcore.finetune`` builds the run's sink above the recipes; recipes report to the sink they get."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import outcore
from outcore.training.config import load_config
from outcore.recipes.full_finetune import finetune as recipe_finetune


def _overrides(inputs: Path, out: Path) -> dict:
    return dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                max_steps=2, eval_every=0, eval_batches=1, output=str(out), ui="none", val_fraction=0.1,
                offload="none")


def test_public_api_builds_the_sink_and_the_recipe_alone_reports_nothing(tiny_run_inputs, tmp_path):
    res = outcore.finetune(**_overrides(tiny_run_inputs, tmp_path / "api"))
    assert res.steps_done == 2
    rows = (tmp_path / "api" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]
    assert (tmp_path / "api" / "loss_curve.png").is_file()
    final = tmp_path / "api" / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert not final.with_name("final.tmp").exists()  # written aside, then renamed

    quiet = recipe_finetune(load_config(overrides=_overrides(tiny_run_inputs, tmp_path / "quiet")))
    assert quiet.steps_done == 2 and not (tmp_path / "quiet" / "metrics.jsonl").exists()


def test_recipes_do_not_import_the_ui():
    code = ("import sys, outcore.recipes.full_finetune, outcore.recipes.export, outcore.training.checkpoint.files, "
            "outcore.training.checkpoint.run_state, outcore.training.checkpoint.dcp; "
            "print([m for m in sys.modules if m.startswith('outcore.tui')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
