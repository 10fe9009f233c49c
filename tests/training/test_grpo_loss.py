"""GRPO's loss equals TRL's on the same tiny model, batch and completions (fp32, within 1e-6):
``GRPOTrainer._compute_loss`` itself for every ``loss_type``, with and without the KL term and
at a temperature other than 1; the group-normalized advantages as TRL's lines compute them."""
from __future__ import annotations

import copy

import pytest
import torch

from outcore.training.loss import CausalLMScorer, completion_logps, group_advantages, grpo_loss
from tests.conftest import make_tiny_llama

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tok():
    from outcore.models import load_tokenizer

    return load_tokenizer("default")


def _batch(tok):
    """4 completions of 2 prompts: prompts left-padded, completions right-padded (TRL's layout)."""
    g = torch.Generator().manual_seed(3)
    prompts = [tok("Two plus two is")["input_ids"], tok("The capital of France")["input_ids"]]
    prompts = [p for p in prompts for _ in range(2)]
    completions = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (5, 3, 6, 2)]
    p, c = max(map(len, prompts)), max(map(len, completions))
    pad = tok.pad_token_id
    return {
        "prompt_ids": torch.tensor([[pad] * (p - len(x)) + x for x in prompts]),
        "prompt_mask": torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts]),
        "completion_ids": torch.tensor([x + [pad] * (c - len(x)) for x in completions]),
        "completion_mask": torch.tensor([[1] * len(x) + [0] * (c - len(x)) for x in completions]),
        "advantages": torch.tensor([0.7, -0.3, 1.1, -1.4]),
    }


def _trainer(tok, model, tmp_path, **kw):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, report_to=[],
                      use_cpu=True, bf16=False, max_completion_length=8, **kw)
    data = Dataset.from_list([{"prompt": "Two plus two is"}] * 4)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                       train_dataset=data, processing_class=tok)


def _ours(model, batch, temperature):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    labels = input_ids.masked_fill(attention == 0, -100)
    labels[:, :batch["prompt_ids"].shape[1]] = -100
    rows = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
    return completion_logps(CausalLMScorer(model), rows, batch["completion_ids"].shape[1], temperature)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta,temperature,off_policy", [(0.0, 1.0, False), (0.04, 0.7, True)])
def test_grpo_loss_equals_trl_compute_loss(tok, tmp_path, loss_type, beta, temperature, off_policy):
    """``off_policy``: old log-probabilities 0.3 away from the policy's, so the ratio is clipped."""
    policy = make_tiny_llama(vocab=len(tok), seed=1)
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    batch = _batch(tok)
    mask = batch["completion_mask"]
    ref_logps = _ours(ref, batch, temperature).detach()
    ours_logps = _ours(copy.deepcopy(policy), batch, temperature)
    old = None
    if off_policy:
        old = ours_logps.detach() + 0.3 * torch.randn(ours_logps.shape, generator=torch.Generator().manual_seed(4))
    ours, kl = grpo_loss(ours_logps, batch["advantages"], mask.float(), loss_type=loss_type, epsilon_low=0.2,
                         epsilon_high=0.28, beta=beta, ref_logps=ref_logps, old_logps=old, max_completion_length=8)

    trainer = _trainer(tok, policy, tmp_path, loss_type=loss_type, temperature=temperature, epsilon=0.2,
                       epsilon_high=0.28)
    # (built with beta 0, so that TRL loads no reference model of its own: the reference's
    # log-probabilities come with the batch, as it passes them to _compute_loss)
    trainer.beta, trainer.current_gradient_accumulation_steps = beta, 1
    inputs = {**batch, "num_items_in_batch": mask.sum(), "ref_per_token_logps": ref_logps}
    if old is not None:
        inputs["old_per_token_logps"] = old
    theirs = trainer._compute_loss(trainer.model, inputs)
    assert abs(float(theirs) - float(ours)) < 1e-6 and abs(float(ours)) > 1e-4
    assert (float(kl) > 0) == (beta > 0)
    ours.backward()  # the loss trains: a gradient reaches the weights
    assert ours_logps.grad_fn is not None


def _trl_advantages(rewards_per_func, weights, g, scale):
    """TRL's lines (GRPOTrainer._generate_and_score_completions, sum_then_normalize)."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    if scale in ["group", "none"]:
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    nan = float("nan")
    per_func = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 1.0], [nan, nan], [0.0, 0.0], [2.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    ours, rewards = group_advantages(per_func, weights, 3, scale)
    assert torch.allclose(ours, _trl_advantages(per_func, weights, 3, scale), atol=1e-6, rtol=0)
    assert ours[3] == 0 and torch.isnan(rewards[3])  # unscored by every function: no advantage
