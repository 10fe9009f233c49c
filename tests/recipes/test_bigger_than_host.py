"""A model bigger than the HOST budget trains with DPO and with GRPO: given a HOST budget under
its weights, and a DEVICE arena (a RAM arena on a CPU) that holds the micro-batch's activations
and a unit's window but not the whole model beside them, ``offload=auto`` plans its largest
unit's weights onto NVMe, and the run equals the in-memory run bit for bit (losses, rollouts,
held-out figures, exported weights)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import outcore
from outcore.offload.store import Tier
from outcore.training.config import load_config
from tests._helpers import RecordingSink, assert_runs_equal

REWARD = '''
def varied(completions, completion_ids, **kw):
    """A reward a random tiny model's completions differ in: their first token and length."""
    return [float(ids[0] % 7) / 7 + 0.1 * len(ids) for ids in completion_ids]
'''

HOST = "2MiB"  # under the tiny model's 6.1 MiB of fp32 weights (and its 12 MiB of AdamW state)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Arithmetic pairs (DPO), the same questions as prompts (GRPO), a reward function."""
    root = tmp_path_factory.mktemp("host")
    rng = random.Random(0)
    pairs, prompts = [], []
    for _ in range(32):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        pairs.append({"prompt": f"{a} plus {b} is", "chosen": f" {a + b}, thank you.", "rejected": f" {a - b}!"})
        prompts.append({"prompt": f"{a} plus {b} is", "answer": str(a + b)})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    (root / "reward.py").write_text(REWARD)
    return root


def _cfg(inputs: Path, data: Path, objective: str, out: Path, **kw):
    base = dict(model=str(inputs / "model"), objective=objective, seq_len=24, batch_size=4, max_steps=3,
                eval_every=0, eval_batches=1, lr=1e-3, warmup_steps=1, output=str(out), ui="none",
                val_fraction=0.25, offload="none")
    if objective == "dpo":
        base.update(data=str(data / "pairs.jsonl"))
    else:
        base.update(data=str(data / "prompts.jsonl"), reward_funcs=f"{data / 'reward.py'}:varied",
                    num_generations=2, max_completion_length=6, temperature=1.3)
    return load_config(overrides={**base, **kw})


def _plan(cfg):
    """The plan the run makes (``FullFinetune.setup``'s call on the model built lazily)."""
    from outcore.models import load_model_lazily
    from outcore.training.build import plan_this_run

    Path(cfg.output).mkdir(parents=True, exist_ok=True)
    model, _, _ = load_model_lazily(cfg.model, tokenizer=False)
    return plan_this_run(cfg, model)


# DEVICE: the micro-batch's activations and a unit's window fit, not the whole model beside them
@pytest.mark.parametrize("objective,device_mem", [("dpo", "48MiB"), ("grpo", "40MiB")])
def test_a_model_bigger_than_the_host_budget_streams_from_nvme(tiny_run_inputs, data, tmp_path, objective,
                                                               device_mem):
    budgets = dict(offload="auto", host_mem=HOST, device_mem=device_mem)
    ooc_cfg = _cfg(tiny_run_inputs, data, objective, tmp_path / "ooc", **budgets)
    plan = _plan(ooc_cfg)
    weights = sum(u.weights_bytes for u in plan.units)
    state = sum(u.state_bytes for u in plan.units)
    assert plan.budgets.host_bytes < weights < weights + state
    assert plan.layout != "none" and {u.name for u in plan.units if u.weights is Tier.NVME} >= {"embed"}

    mem_sink, ooc_sink = RecordingSink(), RecordingSink()
    mem = outcore.finetune(_cfg(tiny_run_inputs, data, objective, tmp_path / "mem"), sink=mem_sink)
    ooc = outcore.finetune(ooc_cfg, sink=ooc_sink)
    assert_runs_equal(mem, ooc, ooc_sink, "full")
    held_out = [[(type(e).__name__, vars(e)) for e in s.events if type(e).__name__.endswith("EvalEvent")]
                for s in (mem_sink, ooc_sink)]
    assert held_out[0] and held_out[0] == held_out[1]
    if objective == "grpo":
        rollouts = [[(e.reward, e.reward_std, e.completion_length) for e in s.events
                     if type(e).__name__ == "GRPOStepEvent"] for s in (mem_sink, ooc_sink)]
        assert rollouts[0] == rollouts[1] and any(std > 0 for _, std, _ in rollouts[0])
