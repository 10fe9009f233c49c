"""GRPO end to end: sampling out of core == sampling in memory with the same seed, training out
of core == in memory bit for bit (full and LoRA), a resumed run == the uninterrupted one, the
step's rollouts and the held-out reward reported, bad reward functions and data stopped with
one line and no checkpoint lost."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import outcore
from outcore.errors import ConfigError, DataError
from outcore.events import GRPOStepEvent, RewardEvalEvent
from outcore.training.config import load_config
from tests._helpers import RecordingSink, exported_weights

REWARDS = '''
def varied(completions, completion_ids, answer, **kw):
    """A reward a random tiny model's completions differ in: their first token and length."""
    assert len(answer) == len(completions)
    return [float(ids[0] % 7) / 7 + 0.1 * len(ids) for ids in completion_ids]

def raises(completions, **kw):
    raise ValueError("no answer here")

def short(completions, **kw):
    return [1.0] * (len(completions) - 1)

def words(completions, **kw):
    return ["good"] * len(completions)

def none_for_all(completions, **kw):
    return [None] * len(completions)
'''


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """Arithmetic prompts with their answers, and a module of reward functions."""
    root = tmp_path_factory.mktemp("grpo")
    rng = random.Random(0)
    rows = []
    for _ in range(32):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"prompt": f"{a} plus {b} is", "answer": str(a + b)})
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root / "prompts.jsonl", root / "rewards.py"


def _cfg(run_inputs: Path, inputs, out: Path, reward="varied", **kw):
    prompts, rewards = inputs
    base = dict(model=str(run_inputs / "model"), data=str(prompts), objective="grpo",
                reward_funcs=f"{rewards}:{reward},format", reward_weights="1,0.5", seq_len=24,
                max_completion_length=6, batch_size=4, num_generations=2, max_steps=2, eval_every=0, eval_batches=1,
                lr=1e-3, warmup_steps=1, output=str(out), ui="none", val_fraction=0.25, offload="none",
                temperature=1.3)
    return load_config(overrides={**base, **kw})


def _rollouts(sink):
    return [e for e in sink.events if isinstance(e, GRPOStepEvent)]


@pytest.mark.parametrize("method,beta", [("full", 0.0), ("lora", 0.0), ("lora", 0.1)])
def test_out_of_core_equals_in_memory(tiny_run_inputs, inputs, tmp_path, method, beta):
    kw = dict(method=method, beta=beta, grad_accum=2)
    mem_sink, ooc_sink = RecordingSink(), RecordingSink()
    mem = outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "mem", **kw), sink=mem_sink)
    ooc = outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "ooc", offload="nvme", **kw), sink=ooc_sink)
    # the same completions sampled (so the same rewards), the same losses, the same weights
    assert [(e.reward, e.completion_length, e.kl) for e in _rollouts(mem_sink)] == \
        [(e.reward, e.completion_length, e.kl) for e in _rollouts(ooc_sink)]
    assert mem.losses == ooc.losses and mem.final_eval_loss == ooc.final_eval_loss
    assert any(e.reward_std > 0 for e in _rollouts(mem_sink))  # advantages not all zero: the step trained
    assert (max(e.kl for e in _rollouts(mem_sink)) > 0) == (beta > 0)
    a, b = exported_weights(mem.output_dir / "final"), exported_weights(ooc.output_dir / "final")
    base = exported_weights(tiny_run_inputs / "model")
    assert any(not torch.equal(t, base[k]) for k, t in a.items() if k in base)  # it trained
    for k, t in a.items():
        if method == "full":
            assert torch.equal(t, b[k]), k
        else:  # adapters merged into the base in another order
            torch.testing.assert_close(b[k], t, rtol=0, atol=1e-6, msg=k)
    assert [e for e in ooc_sink.events if type(e).__name__ == "StepEvent"][-1].tiers["NVME"].read_bytes > 0


def test_qlora_trains_in_memory_and_out_of_core(tiny_run_inputs, tiny_qlora_model, inputs, tmp_path):
    """QLoRA: in memory the base is bitsandbytes' NF4 layers, out of core the same NF4 codes
    stream and are dequantized on fetch; both sample, reward and train the adapters, with the
    KL term against the base (adapters disabled)."""
    kw = dict(method="qlora", model=str(tiny_qlora_model), beta=0.1, grad_accum=2)
    mem_sink, ooc_sink = RecordingSink(), RecordingSink()
    mem = outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "mem", **kw), sink=mem_sink)
    ooc = outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "ooc", offload="nvme", **kw), sink=ooc_sink)
    for sink in (mem_sink, ooc_sink):
        assert any(e.reward_std > 0 for e in _rollouts(sink))  # advantages not all zero: the step trained
        assert _rollouts(sink)[-1].kl > 0  # the adapters moved the policy off its NF4 base
    # bitsandbytes' CPU 4-bit matmul rounds each block's absmax to bf16, the streamed base
    # dequantizes with the fp32 absmax: close, not equal
    assert mem.losses == pytest.approx(ooc.losses, rel=2e-3, abs=1e-5)
    a, b = exported_weights(mem.output_dir / "final"), exported_weights(ooc.output_dir / "final")
    plain = exported_weights(tiny_qlora_model)
    assert any(not torch.equal(t, plain[k]) for k, t in a.items() if "q_proj" in k)  # NF4 base + adapters
    for k, t in a.items():
        torch.testing.assert_close(b[k], t, rtol=0, atol=5e-2, msg=k)
    assert [e for e in ooc_sink.events if type(e).__name__ == "StepEvent"][-1].tiers["NVME"].read_bytes > 0


def test_sampling_out_of_core_equals_in_memory(tiny_run_inputs, inputs, tmp_path, compute_device):
    """The completions themselves, token for token, from the recipe's sampler in both modes (on
    the CPU and on the simulated accelerator, which fails where a GPU would)."""
    from outcore.recipes.grpo import GRPOFinetune
    from outcore.training.lifecycle import Run

    sampled = {}
    for offload in ("none", "nvme"):
        run = Run(_cfg(tiny_run_inputs, inputs, tmp_path / offload, offload=offload, device=compute_device.type))
        recipe = GRPOFinetune(run)
        run.open()
        try:
            recipe.setup()
            prompts = [p.ids for p in recipe.train_set.prompts[:3] for _ in range(2)]
            sampled[offload] = recipe._sample(prompts, seed=7, temperature=1.3)
            assert recipe._sample(prompts, seed=7, temperature=1.3) == sampled[offload]  # seeded
            assert recipe._sample(prompts, seed=8, temperature=1.3) != sampled[offload]
        finally:
            recipe.close(completed=False)
            run._leave()
    assert sampled["none"] == sampled["nvme"] and len(set(map(tuple, sampled["none"]))) > 1


def test_resume_equals_uninterrupted(tiny_run_inputs, inputs, tmp_path):
    kw = dict(offload="nvme", max_steps=4, save_every=2)
    whole_sink = RecordingSink()
    whole = outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "whole", **kw), sink=whole_sink)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        outcore.finetune(_cfg(tiny_run_inputs, inputs, cut, **kw), sink=RecordingSink(interrupt_at=3))
    sink = RecordingSink()
    resumed = outcore.finetune(load_config(overrides={"resume": str(cut), "ui": "none"}), sink=sink)
    assert resumed.losses[-2:] == whole.losses[-2:]
    assert [e.reward for e in _rollouts(sink)] == [e.reward for e in _rollouts(whole_sink)][-2:]
    a, b = exported_weights(whole.output_dir / "final"), exported_weights(resumed.output_dir / "final")
    assert all(torch.equal(t, b[k]) for k, t in a.items())


def test_rollouts_and_held_out_reward_are_reported(tiny_run_inputs, inputs, tmp_path):
    sink = RecordingSink()
    result = outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "run", max_steps=2), sink=sink)
    steps = _rollouts(sink)
    assert [e.step for e in steps] == [1, 2]
    assert all(0 < e.completion_length <= 6 and e.generate_s > 0 and e.train_s > 0 for e in steps)
    held_out = [e for e in sink.events if isinstance(e, RewardEvalEvent)]
    assert [e.step for e in held_out] == [0, 2] and held_out[0].n == 4  # (eval_batches=1 of batch_size prompts)
    assert result.final_eval_loss == -held_out[-1].reward


@pytest.mark.parametrize("reward,message", [
    ("raises", r"reward function '.*:raises' raised ValueError: no answer here"),
    ("short", r"reward function '.*:short' returned 3 rewards for 4 completions"),
    ("words", r"reward function '.*:words' returned 'good', not a number"),
])
def test_a_bad_reward_function_stops_with_one_line_and_no_checkpoint_lost(tiny_run_inputs, inputs, tmp_path,
                                                                         reward, message):
    out = tmp_path / "run"
    outcore.finetune(_cfg(tiny_run_inputs, inputs, out, max_steps=1), sink=RecordingSink())
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    prompts, rewards = inputs
    with pytest.raises(DataError, match=message):
        outcore.finetune(load_config(overrides={"resume": str(out), "ui": "none", "max_steps": 2,
                                                "reward_funcs": f"{rewards}:{reward}", "reward_weights": ""}),
                         sink=RecordingSink())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_unscored_completions_get_no_advantage(tiny_run_inputs, inputs, tmp_path):
    """A function returning None for every completion (TRL: NaN, skipped): with no other reward
    function, nothing trains and the run goes on."""
    prompts, rewards = inputs
    sink = RecordingSink()
    outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "run", reward_funcs=f"{rewards}:none_for_all",
                          reward_weights="", max_steps=1), sink=sink)
    assert _rollouts(sink)[0].reward != _rollouts(sink)[0].reward  # NaN: no completion scored


def test_bad_settings_and_data_are_one_line_errors(tiny_run_inputs, inputs, tmp_path):
    prompts, rewards = inputs
    with pytest.raises(ConfigError, match="needs reward_funcs"):
        load_config(overrides={"objective": "grpo", "batch_size": 8})
    with pytest.raises(ConfigError, match="neither a built-in"):
        load_config(overrides={"objective": "grpo", "batch_size": 8, "reward_funcs": "nonsense"})
    with pytest.raises(ConfigError, match="batch_size=2 must be a multiple of num_generations=8"):
        load_config(overrides={"objective": "grpo", "reward_funcs": "format"})
    with pytest.raises(ConfigError, match="a full fine-tune does not keep; use beta=0"):
        load_config(overrides={"objective": "grpo", "reward_funcs": "format", "batch_size": 8, "beta": 0.04})
    with pytest.raises(ConfigError, match="reward_weights has 1 values for 2 reward_funcs"):
        load_config(overrides={"objective": "grpo", "reward_funcs": "format,exact_answer", "batch_size": 8,
                               "reward_weights": "1"})
    assert load_config(overrides={"objective": "grpo", "reward_funcs": "format", "batch_size": 8}).beta == 0.0
    assert load_config(overrides={"objective": "dpo"}).beta == 0.1
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_module_xyz' \(ModuleNotFoundError"):
        outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "a", reward_funcs="no_such_module_xyz:f",
                              reward_weights=""))
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "b", reward_funcs=f"{rewards}:missing",
                              reward_weights=""))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 plus 1 is", "answer": "2"}\n{"question": "x"}\n')
    with pytest.raises(DataError, match=rf"{bad}:2: prompt-only rows need a 'prompt' field"):
        outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "c", data=str(bad)))
    bad.write_text('{"prompt": "  ", "answer": "2"}\n')
    with pytest.raises(DataError, match=rf"{bad}:1: 'prompt' is empty"):
        outcore.finetune(_cfg(tiny_run_inputs, inputs, tmp_path / "d", data=str(bad)))


def test_shipped_demo_is_the_script_output():
    from outcore.data import build_prompt_datasets
    from outcore.models import load_tokenizer
    from tests._helpers import ROOT, load_module

    demo = load_module(ROOT / "scripts" / "make_grpo_demo.py")
    shipped = ROOT / "data" / "demo" / "arithmetic_prompts.jsonl"
    assert shipped.read_text() == "".join(json.dumps(r) + "\n" for r in demo.prompts(1))
    train, val = build_prompt_datasets(shipped, load_tokenizer("default"), 64, 8, val_fraction=0.2)
    assert len(train) + len(val) == 155 and all(p.columns["answer"] for p in train.prompts)
    assert len({tuple(p.ids) for p in train.prompts + val.prompts}) == 155  # each question once
