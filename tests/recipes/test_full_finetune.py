"""The in-memory reference recipe: end to end, resume, bad input."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from outcore.errors import CheckpointError, ConfigError, IntegrityError, OutcoreError
from outcore.training.config import load_config
from outcore.recipes.full_finetune import finetune
from tests._helpers import RecordingSink


def _cfg(inputs: Path, out: Path, **kw):
    base = dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                max_steps=6, eval_every=3, eval_batches=2, lr=1e-3, warmup_steps=1, output=str(out),
                ui="none", val_fraction=0.1, offload="none")
    return load_config(overrides={**base, **kw})


def test_end_to_end_writes_metrics_config_final(tiny_run_inputs, tmp_path):
    from transformers import AutoModelForCausalLM

    sink = RecordingSink()
    res = finetune(_cfg(tiny_run_inputs, tmp_path / "run"), sink=sink)
    assert res.steps_done == 6 and sink.closed
    assert res.final_eval_loss < res.base_eval_loss  # lr 1e-3 on a tiny model learns fast
    out = tmp_path / "run"
    assert (out / "config.yaml").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    trained = load_file(str(out / "checkpoints" / "step_000006" / "model.safetensors"))
    for name, t in reloaded.state_dict().items():
        if name in trained:
            assert torch.equal(t, trained[name]), name
    kinds = [type(e).__name__ for e in sink.events]
    assert kinds[0] == "RunStarted" and kinds[-1] == "RunFinished"
    assert kinds.count("StepEvent") == 6 and kinds.count("EvalEvent") == 3  # before, at step 3, after


def test_resume_is_bit_identical(tiny_run_inputs, tmp_path):
    full = finetune(_cfg(tiny_run_inputs, tmp_path / "full"), sink=RecordingSink())

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C after step 4; the step-3 checkpoint stays
        finetune(_cfg(tiny_run_inputs, tmp_path / "cut", save_every=3), sink=RecordingSink(interrupt_at=4))
    resumed = finetune(load_config(overrides={"resume": str(tmp_path / "cut"), "ui": "none"}),
                       sink=RecordingSink())
    assert resumed.steps_done == full.steps_done == 6
    a = load_file(str(full.output_dir / "checkpoints" / "step_000006" / "model.safetensors"))
    b = load_file(str(resumed.output_dir / "checkpoints" / "step_000006" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert full.losses[-3:] == resumed.losses[-3:]


def test_output_dir_with_another_run_is_refused(tiny_run_inputs, tmp_path):
    finetune(_cfg(tiny_run_inputs, tmp_path / "run", max_steps=1, eval_every=0), sink=RecordingSink())
    with pytest.raises(ConfigError, match="already holds a run.*--overwrite"):
        finetune(_cfg(tiny_run_inputs, tmp_path / "run", max_steps=1), sink=RecordingSink())
    res = finetune(_cfg(tiny_run_inputs, tmp_path / "run", max_steps=1, overwrite=True), sink=RecordingSink())
    assert res.steps_done == 1


def test_resume_errors_name_the_problem(tiny_run_inputs, tmp_path):
    with pytest.raises(CheckpointError, match="no run found"):
        finetune(load_config(overrides={"resume": str(tmp_path / "nowhere")}), sink=RecordingSink())
    finetune(_cfg(tiny_run_inputs, tmp_path / "run", max_steps=2, eval_every=0), sink=RecordingSink())
    with pytest.raises(CheckpointError, match="seq_len=64 differs"):
        finetune(load_config(overrides={"resume": str(tmp_path / "run"), "seq_len": 64}), sink=RecordingSink())
    # flip one byte of the weights: the checksum catches it, nothing loads silently
    f = tmp_path / "run" / "checkpoints" / "step_000002" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        finetune(load_config(overrides={"resume": str(tmp_path / "run"), "max_steps": 3}), sink=RecordingSink())


def test_offload_cpu_with_activations_on_nvme(tiny_run_inputs, tmp_path, compute_device):
    """Weights and state in HOST, activations to NVMe: the run's store has no swap dir, so the
    activations get a private one (and the run still equals the in-memory one, on its device)."""
    kw = dict(max_steps=2, eval_every=0, max_grad_norm=0.0, device=compute_device.type)
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", **kw), sink=RecordingSink())
    ooc = finetune(_cfg(tiny_run_inputs, tmp_path / "ooc", offload="cpu", activations="offload", **kw),
                   sink=RecordingSink())
    assert mem.losses == ooc.losses


def test_lora_trains_adapters_only(tiny_run_inputs, tmp_path):
    res = finetune(_cfg(tiny_run_inputs, tmp_path / "lora", method="lora", lr=1e-2, max_steps=3,
                        eval_every=0), sink=RecordingSink())
    state = load_file(str(res.output_dir / "checkpoints" / "step_000003" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)
    assert (res.output_dir / "final" / "config.json").is_file()


def test_bad_model_and_seq_len(tiny_run_inputs, tmp_path):
    with pytest.raises(OutcoreError, match="nope"):
        finetune(_cfg(tiny_run_inputs, tmp_path / "a", model=str(tmp_path / "nope")), sink=RecordingSink())
    with pytest.raises(ConfigError, match="seq_len"):
        finetune(_cfg(tiny_run_inputs, tmp_path / "b", seq_len=4096), sink=RecordingSink())


@pytest.mark.slow(ci=True)
def test_default_model_and_data_improve_perplexity(tmp_path):
    """The embedded default (real SmolLM2-135M on real Shakespeare), a few steps."""
    res = finetune(load_config(overrides=dict(output=str(tmp_path / "run"), ui="none", max_steps=4,
                                              seq_len=128, eval_every=0, eval_batches=4,
                                              data_max_bytes=400_000, lr=1e-4, export=False)),
                   sink=RecordingSink())
    assert res.final_eval_loss < res.base_eval_loss


@pytest.mark.parametrize("clip,activations", [(0.0, "keep"), (1.0, "keep"), (0.0, "recompute"), (1.0, "offload")])
def test_offloaded_run_equals_in_memory_run(tiny_run_inputs, tmp_path, clip, activations, compute_device):
    """The recipe with everything on NVMe (and blocks recomputed in the backward, or their
    activations on NVMe too) gives the in-memory run's losses and weights, bit for bit (both
    on the same device)."""
    kw = dict(max_steps=5, eval_every=0, max_grad_norm=clip, device=compute_device.type)
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", **kw), sink=RecordingSink())
    sink = RecordingSink()
    ooc = finetune(_cfg(tiny_run_inputs, tmp_path / "ooc", offload="nvme", activations=activations, **kw),
                   sink=sink)
    assert mem.losses == ooc.losses and mem.final_eval_loss == ooc.final_eval_loss
    a = load_file(str(mem.output_dir / "final" / "model.safetensors"))
    from transformers import AutoModelForCausalLM
    b = AutoModelForCausalLM.from_pretrained(ooc.output_dir / "final").state_dict()
    for k, t in a.items():
        assert torch.equal(t, b[k]), k
    steps = [e for e in sink.events if type(e).__name__ == "StepEvent"]
    assert steps[-1].tiers["NVME"].written_bytes > 0
    # `outcore export` rebuilds the same weights from the out-of-core checkpoint
    from outcore.recipes.export import export_run
    c = AutoModelForCausalLM.from_pretrained(export_run(ooc.output_dir)).state_dict()
    for k, t in a.items():
        assert torch.equal(t, c[k]), k
    assert not (ooc.output_dir / "swap").exists()  # removed on clean exit


def test_offloaded_lora_equals_in_memory_lora_and_resumes(tiny_run_inputs, tmp_path, compute_device):
    """LoRA out of core: the frozen base streams from NVMe, the adapters stay resident;
    losses and the merged export equal the in-memory LoRA run's, and resume is exact."""
    kw = dict(method="lora", lr=1e-2, max_steps=4, eval_every=0, max_grad_norm=1.0, device=compute_device.type)
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", **kw), sink=RecordingSink())
    sink = RecordingSink()
    ooc = finetune(_cfg(tiny_run_inputs, tmp_path / "ooc", offload="nvme", **kw), sink=sink)
    assert mem.losses == ooc.losses and mem.final_eval_loss == ooc.final_eval_loss
    a = load_file(str(mem.output_dir / "final" / "model.safetensors"))
    from transformers import AutoModelForCausalLM
    b = AutoModelForCausalLM.from_pretrained(ooc.output_dir / "final").state_dict()
    for k, t in a.items():
        torch.testing.assert_close(b[k], t, rtol=0, atol=1e-6, msg=k)  # merged in another order
    state = load_file(str(ooc.output_dir / "checkpoints" / "step_000004" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)  # checkpoints hold adapters, not the base
    from outcore.recipes.export import export_run
    c = AutoModelForCausalLM.from_pretrained(export_run(ooc.output_dir)).state_dict()
    for k, t in b.items():
        torch.testing.assert_close(c[k], t, rtol=0, atol=1e-6, msg=k)
    nvme = [e.tiers["NVME"] for e in sink.events if type(e).__name__ == "StepEvent"]
    assert nvme[-1].read_bytes > 0
    with pytest.raises(KeyboardInterrupt):
        finetune(_cfg(tiny_run_inputs, tmp_path / "cut", offload="nvme", save_every=2, **kw),
                 sink=RecordingSink(interrupt_at=3))
    resumed = finetune(load_config(overrides={"resume": str(tmp_path / "cut"), "ui": "none"}),
                       sink=RecordingSink())
    assert ooc.losses[-2:] == resumed.losses[-2:]


def test_qlora_in_memory_and_offloaded(tiny_run_inputs, tiny_qlora_model, tmp_path):
    """QLoRA: in memory the base is bitsandbytes NF4 layers; out of core the same NF4 codes
    stream from NVMe and are dequantized on fetch. Same numbers up to the matmul kernels."""
    from transformers import AutoModelForCausalLM
    kw = dict(method="qlora", lr=1e-2, max_steps=3, eval_every=0, model=str(tiny_qlora_model))
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", **kw), sink=RecordingSink())
    ooc = finetune(_cfg(tiny_run_inputs, tmp_path / "ooc", offload="nvme", **kw), sink=RecordingSink())
    # bitsandbytes' CPU 4-bit matmul rounds the block absmax to bf16; the out-of-core path
    # dequantizes with the fp32 absmax (bitsandbytes' dequantize_4bit): close, not equal.
    assert mem.losses == pytest.approx(ooc.losses, rel=2e-3)
    assert mem.final_eval_loss == pytest.approx(ooc.final_eval_loss, rel=2e-3)
    lora = finetune(_cfg(tiny_run_inputs, tmp_path / "lora", **{**kw, "method": "lora"}), sink=RecordingSink())
    assert lora.losses[0] != mem.losses[0]  # the base really is quantized (not plain LoRA)
    # both exports are plain models: the NF4 base dequantized, the adapters merged in full precision
    a = AutoModelForCausalLM.from_pretrained(mem.output_dir / "final")
    b = AutoModelForCausalLM.from_pretrained(ooc.output_dir / "final")
    assert getattr(a.config, "quantization_config", None) is None
    targets = load_config().lora_targets
    for name, t in b.state_dict().items():
        # frozen NF4 matrices: the same codes (bitsandbytes' CPU kernel rounds absmax to bf16);
        # adapted ones also carry two runs' adapters, trained through different matmul kernels
        adapted = any(f".{m}." in name for m in targets)
        torch.testing.assert_close(a.state_dict()[name], t, rtol=0, atol=5e-2 if adapted else 2e-3, msg=name)
    from outcore.recipes.export import export_run  # the run's checkpoint (adapters) + the NF4 base
    c = AutoModelForCausalLM.from_pretrained(export_run(ooc.output_dir)).state_dict()
    for name, t in b.state_dict().items():
        torch.testing.assert_close(c[name], t, rtol=0, atol=1e-6, msg=name)
    delta = [(a.state_dict()[n] - t).abs().max() for n, t in AutoModelForCausalLM.from_pretrained(
        lora.output_dir / "final").state_dict().items() if "q_proj" in n]
    assert max(delta) > 0  # the NF4 base differs from the plain base


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offloaded_resume_is_bit_identical(tiny_run_inputs, tmp_path, dtype, compute_device):
    """Also for mixed precision (bf16 compute, fp32 masters and state streamed with the units)."""
    kw = dict(offload="nvme", max_steps=5, eval_every=0, dtype=dtype, device=compute_device.type)
    full = finetune(_cfg(tiny_run_inputs, tmp_path / "full", **kw), sink=RecordingSink())
    with pytest.raises(KeyboardInterrupt):
        finetune(_cfg(tiny_run_inputs, tmp_path / "cut", save_every=2, **kw), sink=RecordingSink(interrupt_at=3))
    resumed = finetune(load_config(overrides={"resume": str(tmp_path / "cut"), "ui": "none"}),
                       sink=RecordingSink())
    assert full.losses[-2:] == resumed.losses[-2:]
    a = load_file(str(full.output_dir / "checkpoints" / "step_000005" / "units" / "block.1.safetensors"))
    b = load_file(str(resumed.output_dir / "checkpoints" / "step_000005" / "units" / "block.1.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert ("master" in a) == (dtype == "bfloat16") and a["w"].dtype == getattr(torch, dtype)


def test_update_on_host_equals_the_cpu_run_and_resumes(tiny_run_inputs, tmp_path):
    """``update_on=host`` on the simulated accelerator (forward and backward there, the state
    updated in RAM by the CPU's kernels) gives the CPU run's losses and checkpoints, bit for
    bit, and an interrupted run resumes to the same bits (bf16 compute, fp32 masters in RAM)."""
    from tests.conftest import require_sim

    require_sim()
    kw = dict(offload="nvme", max_steps=5, eval_every=0, dtype="bfloat16", max_grad_norm=1.0, save_every=2)
    cpu = finetune(_cfg(tiny_run_inputs, tmp_path / "cpu", device="cpu", **kw), sink=RecordingSink())
    host = finetune(_cfg(tiny_run_inputs, tmp_path / "host", device="sim", update_on="host", **kw),
                    sink=RecordingSink())
    with pytest.raises(KeyboardInterrupt):
        finetune(_cfg(tiny_run_inputs, tmp_path / "cut", device="sim", update_on="host", **kw),
                 sink=RecordingSink(interrupt_at=3))
    resumed = finetune(load_config(overrides={"resume": str(tmp_path / "cut"), "ui": "none"}), sink=RecordingSink())
    assert cpu.losses == host.losses and host.losses[-2:] == resumed.losses[-2:]
    unit = Path("checkpoints") / "step_000005" / "units" / "block.1.safetensors"
    a, b, c = (load_file(str(r.output_dir / unit)) for r in (cpu, host, resumed))
    assert "master" in a and a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


def test_export_command_and_its_errors(tiny_run_inputs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from outcore.cli import main

    res = finetune(_cfg(tiny_run_inputs, tmp_path / "run", max_steps=2, eval_every=0, export=False),
                   sink=RecordingSink())
    assert main(["export", str(res.output_dir), "--output", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    trained = load_file(str(res.output_dir / "checkpoints" / "step_000002" / "model.safetensors"))
    for k, t in trained.items():
        assert torch.equal(exported[k], t), k
    assert main(["export", str(tmp_path / "nowhere")]) == 2
    assert "holds no outcore run" in capsys.readouterr().err


class _CorruptSwap(RecordingSink):
    """Flips one byte in every 4 KiB page of the swap file after step ``at``: the next read of
    any extent finds its checksum wrong."""

    def __init__(self, swap: Path, at: int):
        super().__init__()
        self.swap, self.at = swap, at

    def emit(self, event):
        super().emit(event)
        if type(event).__name__ == "StepEvent" and event.step == self.at:
            with open(self.swap / "extents.bin", "r+b") as f:
                size = f.seek(0, 2)
                for off in range(100, size, 4096):
                    f.seek(off)
                    b = f.read(1)
                    f.seek(off)
                    f.write(bytes([b[0] ^ 0x01]))


def test_a_corrupt_swap_file_stops_the_run_naming_file_and_unit(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    sink = _CorruptSwap(out / "swap", at=3)
    with pytest.raises(IntegrityError, match=r"checksum mismatch in swap file .*/swap/extents.bin, "
                                             r"extent '(embed|block\.\d|head):\w+'") as e:
        finetune(_cfg(tiny_run_inputs, out, offload="nvme", max_steps=5, save_every=2, eval_every=0), sink=sink)
    assert e.value.exit_code == 4 and sink.closed
    assert not (out / "swap").exists()
    from outcore.training import checkpoint as ckpt
    assert ckpt.load_newest_valid(out)[0].name == "step_000002"  # the last checkpoint, intact


def test_resume_falls_back_to_the_newest_valid_checkpoint_and_says_so(tiny_run_inputs, tmp_path, capsys):
    out = tmp_path / "run"
    finetune(_cfg(tiny_run_inputs, out, max_steps=4, save_every=2, eval_every=0, keep_checkpoints=3,
                  export=False), sink=RecordingSink())
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    f = out / "checkpoints" / "step_000004" / "optimizer.pt"
    f.write_bytes(f.read_bytes()[:-10])  # truncated
    capsys.readouterr()
    res = finetune(load_config(overrides={"resume": str(out), "max_steps": 5, "ui": "none"}), sink=RecordingSink())
    assert res.steps_done == 5
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("outcore")]
    assert err == [f"outcore: warning: checkpoint file {str(f)!r} is corrupt or truncated (checksum mismatch); "
                   "delete its directory to resume from the previous checkpoint; resuming from step_000002 instead"]


@pytest.mark.parametrize("activations", ["keep", "recompute_host"])
def test_padding_free_offloaded_equals_in_memory(tiny_run_inputs, tmp_path, activations):
    """Text packed with its document boundaries (padding_free) trains out of core exactly as in
    memory, block checkpoints offloaded included; the boundaries change what it trains on."""
    text = (tiny_run_inputs / "data.txt").read_text()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):  # ~100-token documents: most 64-token rows hold a boundary
        (docs / f"{i:02d}.txt").write_text(text[i * 400:(i + 1) * 400])
    kw = dict(data=str(docs), seq_len=64, max_steps=3, eval_every=0, export=False)
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", padding_free=True, **kw), sink=RecordingSink())
    sink = RecordingSink()
    ooc = finetune(_cfg(tiny_run_inputs, tmp_path / "ooc", padding_free=True, offload="nvme",
                        activations=activations, **kw), sink=sink)
    assert mem.losses == ooc.losses and mem.final_eval_loss == ooc.final_eval_loss
    started = next(e for e in sink.events if type(e).__name__ == "RunStarted")  # what the views show
    assert started.tokens_per_step == 2 * 64
    assert started.activations == {"keep": "activations kept on DEVICE (keep)",
                                   "recompute_host": "block checkpoints on HOST (recompute_host)"}[activations]
    plain = finetune(_cfg(tiny_run_inputs, tmp_path / "plain", **kw), sink=RecordingSink())
    assert plain.losses != mem.losses


def test_block_checkpoints_are_read_ahead_as_deep_as_the_plan_counts(tiny_run_inputs, tmp_path, monkeypatch):
    """The plan holds its prefetch depth of offloaded checkpoints read ahead (planner/layout.py:
    activation_bytes); the recipe's offloader reads that many ahead, not its own default."""
    import outcore.activations as activations
    from outcore.planner import plan as plan_module

    seen, plans = {}, []
    apply = activations.apply_activation_policy
    monkeypatch.setattr(activations, "apply_activation_policy", lambda *a, **kw: seen.update(kw) or apply(*a, **kw))
    make = plan_module.make_plan
    monkeypatch.setattr(plan_module, "make_plan", lambda *a, **kw: plans.append(make(*a, **kw)) or plans[-1])
    finetune(_cfg(tiny_run_inputs, tmp_path / "run", offload="nvme", activations="recompute_nvme", max_steps=1,
                  eval_every=0, max_grad_norm=0.0), sink=RecordingSink())
    assert plans and plans[-1].activations == "recompute_nvme"
    assert seen["prefetch_depth"] == max(1, plans[-1].prefetch_depth) == plans[-1].activations_read_ahead
