"""The ZO recipe end to end: in memory == streamed from disk, export by replay, resume, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from outcore.errors import ConfigError
from outcore.training.config import load_config
from outcore.recipes.zo_finetune import finetune
from tests._helpers import RecordingSink, exported_weights


def _cfg(inputs: Path, out: Path, **kw):
    base = dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                max_steps=5, eval_every=0, eval_batches=2, lr=1e-3, warmup_steps=1, output=str(out),
                ui="none", val_fraction=0.1, method="zo", optim="mezo", threads=1,
                optim_args={"eps": 1e-2, "n_samples": 2})
    return load_config(overrides={**base, **kw})


def test_in_memory_and_nvme_runs_give_identical_exports(tiny_run_inputs, tmp_path, compute_device):
    sink = RecordingSink()
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", offload="none", device=compute_device.type), sink)
    disk = finetune(_cfg(tiny_run_inputs, tmp_path / "disk", offload="nvme", device=compute_device.type),
                    RecordingSink())
    assert mem.steps_done == disk.steps_done == 5
    assert mem.losses == disk.losses and mem.final_eval_loss == disk.final_eval_loss
    a, b = exported_weights(mem.final_dir), exported_weights(disk.final_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = Path(mem.output_dir)
    assert (out / "config.yaml").is_file()
    lines = (out / "zo_log.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["header"]["schedule"] == "exact"
    assert (out / "zo_log.jsonl").stat().st_size < 4000  # bytes per step, not tensors
    assert not (Path(disk.output_dir) / "swap").exists()  # swap removed on clean exit
    assert any(e.tiers.get("NVME") for e in sink.events if type(e).__name__ == "StepEvent") is False
    assert mem.losses and disk.losses
    kinds = [type(e).__name__ for e in sink.events]
    assert kinds[0] == "RunStarted" and kinds[-1] == "RunFinished" and kinds.count("StepEvent") == 5
    base = load_file(str(tiny_run_inputs / "model" / "model.safetensors"))
    assert any(not torch.equal(a[k], base[k]) for k in base)


@pytest.mark.slow(ci=True)
def test_resume_after_interrupt_matches_uninterrupted(tiny_run_inputs, tmp_path):
    kw = dict(optim="sparse-mezo", optim_args={"eps": 1e-2, "sparsity": 0.5, "mask_every": 2,
                                                "momentum": 0.5})
    full = finetune(_cfg(tiny_run_inputs, tmp_path / "full", **kw), RecordingSink())
    with pytest.raises(KeyboardInterrupt):
        finetune(_cfg(tiny_run_inputs, tmp_path / "cut", **kw), RecordingSink(interrupt_at=3))
    resumed = finetune(_cfg(tiny_run_inputs, tmp_path / "cut", resume=str(tmp_path / "cut"), **kw), RecordingSink())
    assert resumed.steps_done == 5
    a, b = exported_weights(full.final_dir), exported_weights(resumed.final_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow(ci=True)
def test_zo_on_lora_adapters_only(tiny_run_inputs, tmp_path):
    run = finetune(_cfg(tiny_run_inputs, tmp_path / "lora", optim_args={"lora": True, "eps": 1e-2},
                        lora_targets=["q_proj", "v_proj"]), RecordingSink())
    header = json.loads((Path(run.output_dir) / "zo_log.jsonl").read_text().splitlines()[0])["header"]
    assert header["params"] and all("lora_" in p["name"] for p in header["params"])
    assert (Path(run.final_dir) / "model.safetensors").is_file()


@pytest.mark.parametrize("kw,match", [
    ({"optim_args": {"sparsity": 0.5}}, "needs optim=sparse-mezo"),
    ({"optim_args": {"epsilon": 1e-3}}, "optim_args.epsilon"),
    ({"optim": "sparse-mezo", "optim_args": {"sparsity": 0.0}}, "sparsity=0.0"),
    ({"grad_accum": 2}, "grad_accum=2"),
])
def test_bad_zo_options(tiny_run_inputs, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        finetune(_cfg(tiny_run_inputs, tmp_path / "bad", **kw), RecordingSink())


@pytest.mark.slow(ci=True)
def test_a_damaged_log_line_resumes_from_the_steps_before_it(tiny_run_inputs, tmp_path, capsys):
    """A ZO run's checkpoint is its log: a flipped byte in a step line is detected (each line
    carries its checksum), the steps before it are the newest valid checkpoint, and the
    resumed run equals the uninterrupted one."""
    full = finetune(_cfg(tiny_run_inputs, tmp_path / "full"), RecordingSink())
    with pytest.raises(KeyboardInterrupt):
        finetune(_cfg(tiny_run_inputs, tmp_path / "cut"), RecordingSink(interrupt_at=3))
    log = tmp_path / "cut" / "zo_log.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    assert len(lines) == 4  # the header and steps 1..3
    lines[3] = lines[3].replace('"seeds": [', '"seeds": [1', 1)  # a flipped digit, still JSON
    log.write_text("".join(lines))
    resumed = finetune(_cfg(tiny_run_inputs, tmp_path / "cut", resume=str(tmp_path / "cut")), RecordingSink())
    err = capsys.readouterr().err
    assert "line 4 is damaged (checksum mismatch)" in err and "resuming from step 2 instead" in err
    a, b = exported_weights(full.final_dir), exported_weights(resumed.final_dir)
    assert resumed.steps_done == 5 and all(torch.equal(a[k], b[k]) for k in a)
