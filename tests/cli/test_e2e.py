"""`outcore finetune` end to end in a real subprocess, on a tiny model (slow: trains)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow(ci=True)
def test_finetune_cli_plain_run_writes_everything(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "outcore", "finetune", "--model", str(tiny_run_inputs / "model"),
           "--data", str(tiny_run_inputs / "data.txt"), "--seq-len", "32", "--batch-size", "2",
           "--max-steps", "4", "--lr", "1e-3", "--output", str(out), "eval_every=2", "eval_batches=2",
           "warmup_steps=1", "val_fraction=0.1"]
    env = {**os.environ, "CI": "1"}  # auto -> plain
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert sum(re.match(r"step \d+/\d+", line) is not None for line in lines) == 4
    assert any("NVME" in line for line in lines)  # the default run is out of core: its plan is shown
    assert any(line.startswith("eval @ step 0:") for line in lines)
    assert any("eval perplexity" in line and "-> final" in line for line in lines)
    assert lines[-1] == f"outcore: output in {out.resolve()}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "eval_loss" in rows[1] and "eval_loss" in rows[3]  # step 2 and the final eval
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "config.yaml").is_file() and (out / "final").is_dir()

    # the same output directory again without --resume/--overwrite: one line, exit 2
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 2
    assert again.stderr.count("\n") == 1 and again.stderr.startswith("outcore: error: output directory")
