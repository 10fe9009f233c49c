"""precision=bf16-lean through the recipe: the config's rules, and the same run in memory and out
of core (and resumed) giving the same weights bit for bit."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from outcore.errors import ConfigError
from outcore.training.config import FinetuneConfig, load_config
from outcore.recipes.full_finetune import finetune
from tests._helpers import RecordingSink, exported_weights


def _cfg(inputs: Path, out: Path, **kw):
    base = dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                max_steps=4, eval_every=0, eval_batches=1, lr=1e-3, warmup_steps=1, output=str(out),
                ui="none", val_fraction=0.1, precision="bf16-lean", threads=1)
    return load_config(overrides={**base, **kw})


def test_bf16_lean_alone_computes_in_bfloat16(tmp_path):
    cfg = load_config(overrides={"precision": "bf16-lean", "output": str(tmp_path)})
    assert cfg.dtype == "bfloat16" and FinetuneConfig(output=str(tmp_path)).precision == "exact"
    assert load_config(overrides={"precision": "bf16-lean", "dtype": "bfloat16"}).dtype == "bfloat16"


@pytest.mark.parametrize("overrides,match", [
    ({"precision": "bf16-lean", "dtype": "float16"}, r"precision='bf16-lean' .* dtype='float16'"),
    ({"precision": "bf16-lean", "method": "lora"}, r"precision='bf16-lean' .* method='lora'"),
    ({"precision": "fp8"}, r"precision='fp8' is not one of: exact, bf16-lean"),
])
def test_conflicts_are_one_line_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


@pytest.mark.slow(ci=True)  # four tiny runs (AdamW8bit's lean update: tests/offload/engine/test_engine_lean.py)
def test_lean_in_memory_equals_out_of_core_and_resumes(tiny_run_inputs, tmp_path, compute_device):
    on = compute_device.type  # both runs compute there (and the resumed one, by its config)
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", offload="none", device=on), sink=RecordingSink())
    ooc = finetune(_cfg(tiny_run_inputs, tmp_path / "ooc", offload="nvme", device=on), sink=RecordingSink())
    assert mem.losses == ooc.losses
    a, b = exported_weights(mem.final_dir), exported_weights(ooc.final_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    units = load_file(str(ooc.output_dir / "checkpoints" / "step_000004" / "units" / "block.1.safetensors"))
    assert not any("master" in k for k in units) and any("sr_step" in k for k in units)
    with pytest.raises(KeyboardInterrupt):
        finetune(_cfg(tiny_run_inputs, tmp_path / "cut", offload="nvme", save_every=2, device=on),
                 sink=RecordingSink(interrupt_at=3))
    resumed = finetune(load_config(overrides={"resume": str(tmp_path / "cut"), "ui": "none"}), sink=RecordingSink())
    c = exported_weights(resumed.final_dir)
    assert all(torch.equal(a[k], c[k]) for k in a)
