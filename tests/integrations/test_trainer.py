"""OutOfCoreTrainer: a transformers Trainer run out of core gives the in-memory Trainer's weights.

fp32 and the Trainer's default optimizer (``adamw_torch_fused``, which outcore's AdamW equals bit
for bit): the same data order, scheduler, clipping and accumulation give the same bits.
"""
from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from outcore.errors import ConfigError
from outcore.integrations import OutOfCoreTrainer, out_of_core
from outcore.integrations.trainer import UNITS_DIR
from tests._helpers import exported_weights
from tests.conftest import make_tiny_llama


class _Tokens(torch.utils.data.Dataset):
    """Random token rows (labels = inputs): enough for a few steps of a causal LM."""

    def __init__(self, rows: int = 16, seq: int = 16, vocab: int = 256):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, vocab, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out, use_cpu: bool = True, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-3, max_steps=4,
                lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=use_cpu, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


@pytest.fixture
def use_cpu(compute_device) -> bool:
    """The Trainer's ``use_cpu`` for the compute device: the CPU, or the GPU (both Trainers, in
    memory and out of core, on it)."""
    if compute_device.type == "sim":
        pytest.skip("transformers' Trainer picks its device through accelerate, which knows no PrivateUse1 "
                    "device: it cannot train on the simulated accelerator")
    return compute_device.type == "cpu"


def _weights(trainer, out) -> dict[str, torch.Tensor]:
    """The trained weights as ``save_model`` writes them (out of core: one shard per unit)."""
    trainer.save_model(str(out))
    return exported_weights(out)


def _logged(key: str):
    """A trainer's logged values of ``key``, in order."""
    return lambda t: [h[key] for h in t.state.log_history if key in h]


@pytest.mark.parametrize("accum,clip", [(1, 0.0), (2, 1.0)], ids=["step-in-backward", "accum-clip"])
def test_out_of_core_trainer_equals_in_memory(tmp_path, accum, clip, use_cpu):
    kw = dict(gradient_accumulation_steps=accum, max_grad_norm=clip, eval_strategy="steps", eval_steps=2,
              use_cpu=use_cpu)
    data = dict(train_dataset=_Tokens(), eval_dataset=_Tokens(rows=4))
    ref = Trainer(model=make_tiny_llama(), args=_args(tmp_path / "ref", **kw), **data)
    ref.train()
    ooc = OutOfCoreTrainer(model=make_tiny_llama(), args=_args(tmp_path / "ooc", **kw), **data)
    ooc.train()
    assert ooc.engine.step_in_backward == (accum == 1 and not clip)  # both engine paths are covered
    try:
        want, got = _weights(ref, tmp_path / "ref_final"), _weights(ooc, tmp_path / "ooc_final")
    finally:
        ooc.close()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    losses = _logged("loss")
    assert losses(ooc) == losses(ref) and len(losses(ref)) == 4
    lrs = _logged("learning_rate")
    assert lrs(ooc) == lrs(ref)
    evals = _logged("eval_loss")
    assert evals(ooc) == evals(ref) and len(evals(ref)) == 2  # evaluation streams through the engine too
    if clip:
        norms = _logged("grad_norm")
        assert norms(ooc) == norms(ref)
    # the step changed the weights (the comparison above is not of two untouched models)
    assert not torch.equal(got["model.norm.weight"], make_tiny_llama().model.norm.weight)


def test_resume_from_checkpoint_equals_uninterrupted(tmp_path, use_cpu):
    kw = dict(gradient_accumulation_steps=2, max_grad_norm=1.0, save_strategy="steps", save_steps=2, use_cpu=use_cpu)
    whole = OutOfCoreTrainer(model=make_tiny_llama(), args=_args(tmp_path / "whole", **kw), train_dataset=_Tokens())
    whole.train()
    assert (tmp_path / "whole" / "checkpoint-2" / UNITS_DIR / "units.json").is_file()
    resumed = OutOfCoreTrainer(model=make_tiny_llama(seed=5), args=_args(tmp_path / "whole", **kw),
                               train_dataset=_Tokens())
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    try:
        want, got = _weights(whole, tmp_path / "a"), _weights(resumed, tmp_path / "b")
    finally:
        whole.close()
        resumed.close()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_out_of_core_wraps_a_trainer_subclass():
    class MyTrainer(Trainer):
        pass

    cls = out_of_core(MyTrainer)
    assert issubclass(cls, MyTrainer) and cls.__name__ == "OutOfCoreMyTrainer"
    with pytest.raises(ConfigError, match="transformers.Trainer"):
        out_of_core(dict)


@pytest.mark.parametrize("kw,match", [
    (dict(bf16=True), "load the model in bfloat16"),
    (dict(optim="sgd"), "optim='sgd'"),
    (dict(weight_decay=0.01), "weight_decay=0.01"),
    (dict(gradient_checkpointing=True), "gradient_checkpointing"),
    pytest.param(dict(activation_checkpointing=True), "activation_checkpointing", marks=pytest.mark.skipif(
        "activation_checkpointing" not in TrainingArguments.__dataclass_fields__,
        reason="transformers before 5.24 names it gradient_checkpointing only")),
])
def test_refused_arguments_are_one_line_errors(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match) as err:
        OutOfCoreTrainer(model=make_tiny_llama(), args=_args(tmp_path, **kw), train_dataset=_Tokens())
    assert "\n" not in str(err.value)


def test_refuses_a_torch_optimizer_and_an_unknown_offload(tmp_path):
    model = make_tiny_llama()
    with pytest.raises(ConfigError, match="outcore.optim"):
        OutOfCoreTrainer(model=model, args=_args(tmp_path), train_dataset=_Tokens(),
                         optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(ConfigError, match="offload='gpu'"):
        OutOfCoreTrainer(model=model, args=_args(tmp_path), train_dataset=_Tokens(), offload="gpu")


def _lora(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    return get_peft_model(make_tiny_llama(seed=seed), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                   target_modules=["q_proj", "v_proj"]))


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_trainer_streams_the_base_and_equals_in_memory(tmp_path, use_cpu):
    """A peft model: the frozen base streams, the Trainer's own AdamW (weight decay groups, its
    clip) steps the resident adapters; in memory, out of core and resumed agree bit for bit."""
    kw = dict(gradient_accumulation_steps=2, max_grad_norm=1.0, weight_decay=0.01, save_strategy="steps",
              save_steps=2, use_cpu=use_cpu)
    ref = Trainer(model=_lora(), args=_args(tmp_path / "ref", **kw), train_dataset=_Tokens())
    ref.train()
    ooc = OutOfCoreTrainer(model=_lora(), args=_args(tmp_path / "ooc", **kw), train_dataset=_Tokens())
    ooc.train()
    assert ooc.engine.resident and all(not s.param.requires_grad for u in ooc.engine.units for s in u.slots)
    fresh = _lora()  # the same base (a LoRA checkpoint holds the adapters only); adapters scrambled:
    with torch.no_grad():  # the checkpoint's must replace them
        for p in fresh.parameters():
            if p.requires_grad:
                p.normal_()
    resumed = OutOfCoreTrainer(model=fresh, args=_args(tmp_path / "ooc", **kw), train_dataset=_Tokens())
    resumed.train(resume_from_checkpoint=str(tmp_path / "ooc" / "checkpoint-2"))
    want, got, again = _adapters(ref.model), _adapters(ooc.model), _adapters(resumed.model)
    ooc.close()
    resumed.close()
    assert want.keys() == got.keys() and len(want) == 16
    for name in want:
        assert torch.equal(want[name], got[name]) and torch.equal(want[name], again[name]), name
    norms = _logged("grad_norm")
    assert norms(ooc) == norms(ref) and len(norms(ref)) == 4
    assert (tmp_path / "ooc" / "checkpoint-2" / "adapter_model.safetensors").is_file()
