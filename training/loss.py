"""The training loss: a causal LM's forward as the run's loss and as per-token negative
log-likelihoods (:class:`CausalLMScorer`), and its token-weighted mean over the held-out
batches (:func:`mean_eval_loss`)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..offload.device import to_device


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The model's inputs of ``batch``: ids and attention mask, or, for rows packed with
    document boundaries, ids and position ids with no mask and no KV cache, from which
    transformers masks attention per document (``create_causal_mask``; a cache or a mask
    would hide the documents from it)."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the CPU for a meta-device model, not yet placed)."""
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None or p.device.type == "meta" else p.device


class CausalLMScorer:
    """The forward of a causal LM as the run's loss and as per-token negative log-likelihoods.

    Args:
        model: a Hugging Face causal LM (or a peft wrapper of one), in memory or
            wrapped by the out-of-core engine.
        device: where it computes: batches are moved there (default: its parameters' device;
            give it for a model still on the meta device, which the engine will place).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None) -> None:
        from ..kernels.linear_cross_entropy import CausalLMHeadLoss, head_loss_covers
        from ..models import model_parts, unwrap_peft

        base = unwrap_peft(model)
        self.model, self.decoder, self.head_loss = model, base.model, None
        self.device = device or _device_of(model)
        # a loss the chunked head does not cover (soft-capping, the routers' auxiliary loss)
        # takes the model's own forward
        if head_loss_covers(base.config):
            self.head_loss = CausalLMHeadLoss(model_parts(base).lm_head)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token loss over the batch's labelled tokens (-100 = no loss)."""
        batch = to_device(batch, self.device)
        if self.head_loss is None:
            return self.model(**model_inputs(batch), labels=batch["labels"]).loss
        return self.head_loss(self._hidden(batch), batch["labels"])

    def token_nll(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, T]`` fp32: at t, -log p(labels[t + 1] | tokens <= t); 0 where the label is -100."""
        batch = to_device(batch, self.device)
        labels = batch["labels"]
        if self.head_loss is not None:
            return self.head_loss(self._hidden(batch), labels, reduction="none")
        logits = self.model(**model_inputs(batch)).logits
        nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="none")
        return F.pad(nll, (0, 1))

    def _hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.decoder(**model_inputs(batch)).last_hidden_state


@torch.no_grad()
def mean_eval_loss(loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], dataset: Any,
             batch_size: int, n_batches: int) -> float:
    """Token-weighted mean loss over the fixed validation batches.

    Args:
        loss_fn: batch -> mean loss over its labelled tokens.
        n_batches: how many batches of the validation set (0 = all of it).

    Returns:
        The mean loss (a float: this is a host sync, once per evaluation).
    """
    from ..data import eval_batches

    total, tokens = 0.0, 0
    for batch in eval_batches(dataset, batch_size, n_batches):
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(loss_fn(batch)) * n
        tokens += n
    return total / max(tokens, 1)


# --------------------------------------------------------------------------- preference losses
# Each takes per-sequence log-probabilities of the completions (``[B]`` fp32: chosen and
# rejected rows of one batch) and returns ``(loss, chosen_rewards, rejected_rewards)``, the
# rewards detached, for the dashboard. The formulas are TRL's (tests check them against it).

def sequence_logps(token_nll: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """``[B]``: the log-probability of each row's labelled tokens (their mean with ``average``),
    from :meth:`CausalLMScorer.token_nll` (``[B, T]``, 0 off the labels)."""
    logps = -token_nll.sum(dim=1)
    if not average:
        return logps
    return logps / (labels[:, 1:] != -100).sum(dim=1).clamp(min=1)


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (sigmoid): ``-log σ(β((π_c - ref_c) - (π_r - ref_r)))``, summed log-probabilities."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio)).mean()
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x < 0, branching at -ln 2 to avoid cancellation."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_nll: torch.Tensor,
              beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO: the chosen completions' NLL minus ``β log σ(log odds(c) - log odds(r))``, on
    per-token mean log-probabilities; no reference model."""
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    loss = chosen_nll - (beta * F.logsigmoid(log_odds)).mean()
    return loss, beta * chosen.detach(), beta * rejected.detach()


def simpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float,
               gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO: ``-log σ(β(π_c - π_r) - γ)`` on per-token mean log-probabilities; no reference
    model (TRL's CPO trainer with ``loss_type="simpo"``, ``cpo_alpha=0``)."""
    loss = -F.logsigmoid(beta * ((chosen - rejected) - gamma / beta)).mean()
    return loss, beta * chosen.detach(), beta * rejected.detach()


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor,
             desirable: torch.Tensor, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO (TRL's ``loss_type="kto"``) on unpaired completions, summed log-probabilities.

    A desirable completion's loss is ``1 - σ(β(r - z))``, an undesirable one's ``1 - σ(β(z - r))``,
    with ``r`` its log-ratio to the reference and ``z`` the KL estimate: the batch's mean
    log-ratio of its mismatched completions (each prompt with another row's completion),
    detached and clamped at 0. The loss is the mean over the batch of the weighted losses.

    Returns:
        ``(loss, rewards [B] = β r (detached), z)``.
    """
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    ratio = logps - ref_logps
    desirable = desirable.to(device=ratio.device, dtype=torch.bool)
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses.mean(), beta * ratio.detach(), kl


# --------------------------------------------------------------------------- GRPO
# Per-token log-probabilities of sampled completions, group-normalized advantages and the
# clipped objective with its KL term, as TRL's GRPOTrainer computes them (tests check them
# against its own code). Per-token tensors are ``[B, C]``: C completion positions, ``mask`` 1
# on a completion's tokens (its end-of-sequence token included), 0 on the padding after it.

def completion_logps(scorer: CausalLMScorer, batch: dict[str, torch.Tensor], completion: int,
                     temperature: float = 1.0) -> torch.Tensor:
    """``[B, C]`` fp32: the log-probability of each of the last ``completion`` tokens of every
    row (``batch``: prompt then completion, labels -100 off the completion), at
    ``temperature`` as TRL scores them (the logits divided by it; 0 where the label is -100).

    Out of core the head's chunked loss computes them too; the hidden state is divided instead
    of the logits (``W(h/T) = (Wh)/T`` but for rounding), so no logits are materialized.
    """
    if temperature == 1.0:
        nll = scorer.token_nll(batch)
    else:
        batch = to_device(batch, scorer.device)
        labels = batch["labels"]
        if scorer.head_loss is not None:
            nll = scorer.head_loss(scorer._hidden(batch) / temperature, labels, reduction="none")
        else:
            logits = scorer.model(**model_inputs(batch)).logits
            nll = F.pad(F.cross_entropy(logits[:, :-1].float().transpose(1, 2) / temperature, labels[:, 1:],
                                        reduction="none"), (0, 1))
    # position t predicts token t + 1: the completion's C tokens are predicted at T-C-1 … T-2
    total = nll.shape[1]
    return -nll[:, total - completion - 1:total - 1]


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (TRL's ``nanstd``; NaN below 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages [N], rewards [N])`` of ``N`` completions, ``num_generations`` per prompt in
    order, from ``[N, F]`` rewards (NaN: not scored): the weighted sum (NaN when no function
    scored it), minus its group's mean, over the group's standard deviation (``scale_rewards``
    ``group``), the whole batch's (``batch``) or 1 (``none``), +1e-4; NaN advantages are 0."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = _nanstd(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), rewards


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: str,
              epsilon_low: float, epsilon_high: float, beta: float = 0.0, ref_logps: torch.Tensor | None = None,
              old_logps: torch.Tensor | None = None, max_completion_length: int = 0,
              tokens: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, mean KL)`` of a micro-batch of completions: TRL's clipped surrogate with the
    k3 KL estimator (importance-weighted, as TRL's default), reduced as ``loss_type`` says.

    Args:
        logps: ``[B, C]`` the policy's per-token log-probabilities (with their graph).
        advantages: ``[B]``.
        mask: ``[B, C]`` 1 on completion tokens.
        loss_type: ``grpo`` (mean per sequence, then over sequences), ``bnpo`` (mean over the
            micro-batch's tokens), ``dr_grpo`` (sum over ``B · max_completion_length``), ``dapo``
            (sum over ``tokens``, the step's completion tokens).
        epsilon_low, epsilon_high: the ratio's clip range ``[1 - low, 1 + high]``.
        beta: the KL term's weight (0: none, ``ref_logps`` unused).
        ref_logps: ``[B, C]`` the reference's, when ``beta > 0``.
        old_logps: the sampling policy's (None: ``logps`` detached, ratio 1, as TRL with one
            update per generation batch).
    """
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros((), device=logps.device)
    if beta != 0.0:
        delta = ref_logps - logps
        per_token_kl = torch.exp(delta) - delta - 1
        kl = ((per_token_kl * mask).sum() / mask.sum().clamp(min=1.0)).detach()
        # times the ratio (TRL's default use_bias_correction_kl): 1 in value, but its gradient
        # makes the KL's the unbiased reverse-KL gradient
        per_token = per_token + beta * per_token_kl * ratio
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    elif loss_type == "dapo":
        normalizer = mask.sum() if tokens is None else torch.as_tensor(tokens, device=logps.device)
        loss = (per_token * mask).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}")
    return loss, kl
