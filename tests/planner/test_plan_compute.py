"""The plan's compute rates: timed on a real block and head when no rate is given, used per unit kind."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from outcore.planner import Budgets, make_plan
from outcore.planner.compute import MAX_MEASURED_PARAMS, _narrowed, measure_compute_rates, measure_update_rate
from outcore.planner.sizes import forward_flops_per_token, model_spec, unit_bytes

GiB = 1 << 30
BIG = Budgets(device_bytes=64 * GiB, host_bytes=64 * GiB, nvme_bytes=1 << 40, ram_bytes=64 * GiB,
              disk_read_gbps=2.0, disk_write_gbps=1.0, h2d_gbps=10.0, d2h_gbps=10.0, host_mem_gbps=10.0,
              measured=True)


def _config(**kw) -> LlamaConfig:
    dims = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaConfig(**{**dims, **kw})


def test_a_block_and_a_head_are_timed_forward_and_backward():
    rates = measure_compute_rates(model_spec(_config()), torch.float32, 32, "cpu", matmul=1e11)
    assert rates.block > 0 and rates.head > 0
    assert rates.of("block") == rates.block and rates.of("head") == rates.head
    assert rates.of("embed") == rates.matmul == 1e11


def _block_params(hidden: int, intermediate: int, heads: int, kv: int, head_dim: int) -> int:
    return hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * intermediate


@pytest.mark.parametrize("dims", [(4096, 14336, 32, 8, 128), (2048, 8192, 32, 32, 64), (576, 1536, 9, 3, 64)])
def test_a_wide_block_is_timed_narrower_in_whole_key_value_groups(dims):
    """8B (218M parameters a block) is timed narrower; 1.7B and SmolLM2-135M at their own width."""
    hidden, intermediate, heads, kv, head_dim = dims
    inter, h, k, width = _narrowed(*dims)
    if _block_params(*dims) <= MAX_MEASURED_PARAMS:
        assert (inter, h, k, width) == (intermediate, heads, kv, hidden)
    else:
        assert h // k == heads // kv and width == h * head_dim < hidden and inter < intermediate
        assert _block_params(width, inter, h, k, head_dim) <= 1.2 * MAX_MEASURED_PARAMS


def test_a_plan_without_a_rate_times_this_machine_and_says_so():
    config = _config()
    plan = make_plan(config, offload="none", seq_len=32, batch_size=2, budgets=BIG)  # flops 0: measure
    assert any("compute timed here" in n for n in plan.notes)
    spec = model_spec(config)
    rates = measure_compute_rates(spec, torch.float32, 32, "cpu", plan.budgets.flops)  # cached: the same
    units = unit_bytes(spec, method="full", optim="adamw", dtype="float32")
    expect = sum(2 * 32 * forward_flops_per_token(spec, u, 32) * 3 / rates.of(u.kind) for u in units)
    assert plan.time.compute_s == pytest.approx(expect)


def test_a_given_rate_is_used_as_is_and_nothing_is_timed(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("timed although a rate was given")
    monkeypatch.setattr("outcore.planner.plan.measure_compute_rates", refuse)
    monkeypatch.setattr("outcore.planner.plan.measure_update_rate", refuse)
    plan = make_plan(_config(), offload="none", seq_len=32, batch_size=2, budgets=dataclasses.replace(BIG, flops=1e10))
    assert not any("timed here" in n for n in plan.notes)


@pytest.mark.parametrize("optim,precision,dtype", [("adamw8bit", "bf16-lean", "bfloat16"),
                                                   ("adamw8bit", "exact", "bfloat16"), ("adamw", "exact", "float32")])
def test_a_cpu_full_finetune_times_its_update(optim, precision, dtype):
    """The optimizer steps the model's MLP shape here; the plan's update is the trained
    parameters at that rate, plus a master's widening and rounding bytes (exact bf16)."""
    config = _config()
    plan = make_plan(config, optim=optim, dtype=dtype, precision=precision, offload="none", seq_len=32,
                     budgets=BIG)
    assert any("optimizer update timed here" in n for n in plan.notes)
    spec = model_spec(config)
    rate = measure_update_rate(spec, optim, None, precision)  # cached: the plan's
    assert rate > 0
    trained = sum(u.trainable for u in unit_bytes(spec, method="full", optim=optim, dtype=dtype, precision=precision))
    master = 14 * trained / 10e9 if (dtype, precision) == ("bfloat16", "exact") else 0.0
    assert plan.time.update_s == pytest.approx(trained / rate + master)


def test_lora_and_given_rates_keep_the_bytes_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("an update timed where none should be")
    monkeypatch.setattr("outcore.planner.plan.measure_update_rate", refuse)
    plan = make_plan(_config(), method="lora", offload="none", seq_len=32, budgets=BIG)
    assert not any("optimizer update timed" in n for n in plan.notes)
