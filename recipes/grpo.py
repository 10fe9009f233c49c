"""GRPO — reinforcement learning with verifiable rewards — with full, LoRA or QLoRA, in memory or
out of core.

The full fine-tuning recipe with other data and another step: everything else (the model in
memory or streamed through the tiers, the trainer, checkpoints, export, the run lifecycle) is
``FullFinetune``'s. A step, for each of its micro-batches of ``batch_size / num_generations``
prompts:

1. **sample** ``num_generations`` completions of each prompt from the policy as it is —
   transformers' ``generate`` with its KV cache, at ``temperature``, up to
   ``max_completion_length`` tokens. Out of core every generated token is one pass of the
   weights through the tiers (all the micro-batch's completions share it); the logits go
   through the head's loss module, whose hooks bind and release the head. The sampling seed of
   a micro-batch is a function of (seed, step, rank, micro-batch), so in-memory and out-of-core
   runs sample the same completions and a resumed run those of the uninterrupted one;
2. **reward** them with the configured functions (``training/rewards.py``) and turn the
   rewards into group-normalized advantages (``training/loss.py:group_advantages``);
3. with a KL term (``beta > 0``, adapters only), one forward of the **reference** — the base,
   adapters disabled — per micro-batch;

then one training step on all of them with TRL's clipped objective
(``training/loss.py:grpo_loss``). The old log-probabilities are the sampling policy's, detached:
with one update per generation batch the ratio is 1, as in TRL's default. A full fine-tune has
no reference to keep (its initial weights would be a second copy), so it refuses ``beta > 0``.

The held-out evaluation completes each held-out prompt once, greedily, and reports the mean
reward (``RewardEvalEvent``); the run's eval loss is minus that reward.
"""
from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .._faults import fault_point
from ..events import GRPOStepEvent, RewardEvalEvent
from ..training import distributed as dist
from ..training.lifecycle import Evaluation, Run, Stepped
from ..training.loss import completion_logps, group_advantages, grpo_loss
from ..training.rewards import load_reward_functions, score
from .full_finetune import FullFinetune

IGNORE = -100


class GRPOFinetune(FullFinetune):
    """Train on prompt-only JSONL rows with GRPO and ``cfg.method`` (full, lora, qlora), in
    memory or out of core.

    Args:
        run: the run it is part of.

    Raises:
        ConfigError: a reward function that cannot be imported (before any work).
    """

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        cfg = self.cfg
        self.rewards = load_reward_functions(cfg.reward_funcs, cfg.reward_pattern)
        self.weights = torch.tensor(cfg.reward_weights or [1.0] * len(self.rewards), dtype=torch.float32)
        self._kl: list[torch.Tensor] = []  # the step's micro-batches' mean KL (read once per step)

    def _datasets(self) -> tuple[Any, Any]:
        from ..data import build_prompt_datasets

        cfg = self.cfg
        return build_prompt_datasets(cfg.data, self.tokenizer, cfg.seq_len, cfg.max_completion_length,
                                     seed=cfg.seed, val_fraction=cfg.val_fraction, max_bytes=cfg.data_max_bytes)

    def _prepare(self) -> None:
        """A micro-batch draws ``batch_size / num_generations`` prompts (``batch_size`` counts
        completions, as TRL's); the eos tokens that end a completion."""
        from ..data import BatchLoader

        cfg = self.cfg
        self.loader = BatchLoader(self.train_set, cfg.batch_size // cfg.num_generations, seed=cfg.seed)
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos = [self.tokenizer.eos_token_id, *[e for e in eos if e != self.tokenizer.eos_token_id]]
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]

    # ------------------------------------------------------------------ sampling
    @contextmanager
    def _generating(self) -> Iterator[torch.nn.Module]:
        """The causal LM ready to ``generate``: eval mode, KV cache on; out of core its logits
        computed by the head's loss module (the head unit's last, whose hook releases it)."""
        from ..models import unwrap_peft

        base = unwrap_peft(self.model)  # (LoRA layers sit inside it: adapters active)
        head = base.get_output_embeddings()
        swap = self.engine is not None and self.scorer.head_loss is not None
        if swap:
            base.set_output_embeddings(_LogitsThrough(self.scorer.head_loss))
        self.model.eval()
        base.config.use_cache = True
        try:
            yield base
        finally:
            base.config.use_cache = False
            self.model.train()
            if swap:
                base.set_output_embeddings(head)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[list[int]], seed: int, temperature: float) -> list[list[int]]:
        """One completion per prompt (left-padded into one batch), each cut after its first
        end-of-sequence token (kept)."""
        from transformers import GenerationConfig

        cfg, device = self.cfg, self.run.device
        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompt_ids], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        sampled = temperature > 0  # (the held-out evaluation decodes greedily)
        config = GenerationConfig(max_new_tokens=cfg.max_completion_length, do_sample=sampled, pad_token_id=self.pad,
                                  eos_token_id=self.eos, temperature=temperature if sampled else None,
                                  top_p=1.0 if sampled else None, top_k=0 if sampled else None)
        # a private RNG stream per micro-batch: the run's own RNG state (dropout's) is untouched
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), self._generating() as lm:
            torch.manual_seed(seed)
            out = lm.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        rows = out[:, width:].tolist()
        return [row[:next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))] for row in rows]

    def _seed(self, step: int, micro: int) -> int:
        """The sampling seed of a micro-batch: a function of (seed, step, rank, micro-batch) only."""
        key = f"{self.cfg.seed}:{step}:{self.run.ranks.rank}:{micro}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:7], "little")

    def _rows(self, prompt_ids: list[list[int]], completions: list[list[int]]) -> dict[str, torch.Tensor]:
        """Prompt (left-padded) then completion (right-padded) token rows, labelled on the
        completion: what TRL's loss scores, with the same attention mask."""
        p, c = max(len(x) for x in prompt_ids), max(len(x) for x in completions)
        input_ids, attention, labels, mask = [], [], [], []
        for prompt, done in zip(prompt_ids, completions):
            gap, tail = p - len(prompt), c - len(done)
            input_ids.append([self.pad] * gap + prompt + done + [self.pad] * tail)
            attention.append([0] * gap + [1] * (len(prompt) + len(done)) + [0] * tail)
            labels.append([IGNORE] * p + done + [IGNORE] * tail)
            mask.append([1] * len(done) + [0] * tail)
        rows = {"input_ids": input_ids, "attention_mask": attention, "labels": labels, "completion_mask": mask}
        return {k: torch.tensor(v) for k, v in rows.items()}

    def _rollout(self, batch: dict[str, torch.Tensor], dataset: Any, seed: int,
                 temperature: float, generations: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Sample, reward and score one micro-batch of prompts: ``(training rows, rewards [N])``."""
        prompts = dataset.rows(batch)
        prompt_ids = [p.ids for p in prompts for _ in range(generations)]  # a group: consecutive rows
        completions = self._sample(prompt_ids, seed, temperature)
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        given = [p.prompt for p in prompts for _ in range(generations)]
        if isinstance(given[0], list):  # conversational prompts get conversational completions (TRL's)
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        columns = {k: [p.columns.get(k) for p in prompts for _ in range(generations)]
                   for k in dict.fromkeys(k for p in prompts for k in p.columns)}
        per_func = torch.tensor(score(self.rewards, given, texts, completions, columns), dtype=torch.float32).t()
        advantages, rewards = group_advantages(per_func, self.weights, generations, self.cfg.scale_rewards)
        rows = self._rows(prompt_ids, completions)
        rows["advantages"] = advantages
        return rows, rewards

    @torch.no_grad()
    def _reference(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's per-token log-probabilities: the base, adapters disabled."""
        self.model.eval()
        with self.model.disable_adapter():
            ref = completion_logps(self.scorer, rows, rows["completion_mask"].shape[1], self.cfg.temperature)
        self.model.train()
        return ref.float().cpu()

    # ------------------------------------------------------------------ train
    def step(self, lr: float) -> Stepped:
        """Sample and reward every micro-batch's completions, then one optimizer step on them."""
        cfg, t0 = self.cfg, time.perf_counter()
        micro = dist.my_micro_batches(self.loader, cfg.grad_accum, self.run.ranks)
        rollouts, rewards = [], []
        for i, batch in enumerate(micro):
            rows, reward = self._rollout(batch, self.train_set, self._seed(self.run.step, i), cfg.temperature,
                                         cfg.num_generations)
            if cfg.beta > 0:
                rows["ref_logps"] = self._reference(rows)
            rollouts.append(rows)
            rewards.append(reward)
        # dapo divides by the step's completion tokens; the trainer divides each micro-batch's loss by their number
        tokens = sum(int(r["completion_mask"].sum()) for r in rollouts)
        for rows in rollouts:
            rows["tokens"] = torch.tensor(float(tokens) / len(rollouts))
        t1 = time.perf_counter()
        self._kl.clear()
        loss = self.trainer.train_step(self.loss, rollouts, lr)
        t2 = time.perf_counter()
        reward = torch.cat(rewards)
        lengths = torch.cat([r["completion_mask"].sum(1) for r in rollouts]).float()
        kl = float(torch.stack(self._kl).mean()) if self._kl else 0.0
        event = GRPOStepEvent(step=self.run.step + 1, reward=float(reward.nanmean()),
                              reward_std=float(_std(reward)), kl=kl, completion_length=float(lengths.mean()),
                              generate_s=t1 - t0, train_s=t2 - t1)
        return Stepped(loss, grad_norm=self.trainer.last_grad_norm, rollouts=event)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """TRL's GRPO loss of one micro-batch of completions (``model`` is the scorer's)."""
        cfg = self.cfg
        mask = batch["completion_mask"].to(self.run.device)
        logps = completion_logps(self.scorer, batch, mask.shape[1], cfg.temperature)
        ref = batch.get("ref_logps")
        loss, kl = grpo_loss(logps, batch["advantages"].to(logps.device), mask.to(logps.dtype),
                             loss_type=cfg.loss_type, epsilon_low=cfg.epsilon,
                             epsilon_high=cfg.epsilon_high or cfg.epsilon, beta=cfg.beta,
                             ref_logps=None if ref is None else ref.to(logps.device),
                             max_completion_length=cfg.max_completion_length,
                             tokens=batch["tokens"].to(logps.device))
        self._kl.append(kl)
        return loss

    @torch.no_grad()
    def evaluate(self, step: int) -> Evaluation:
        """Complete each held-out prompt once, greedily, and reward it: minus the mean reward
        is the eval loss."""
        from ..data import eval_batches

        fault_point("eval")
        cfg, rewards, lengths = self.cfg, [], []
        for batch in eval_batches(self.val_set, cfg.batch_size, cfg.eval_batches):
            rows, reward = self._rollout(batch, self.val_set, 0, 0.0, 1)
            rewards.append(reward)
            lengths.append(rows["completion_mask"].sum(1).float())
        reward = torch.cat(rewards) if rewards else torch.zeros(0)
        mean = float(reward.nanmean()) if reward.numel() else 0.0
        length = float(torch.cat(lengths).mean()) if lengths else 0.0
        event = RewardEvalEvent(step=step, n=int(reward.numel()), reward=mean, reward_std=float(_std(reward)),
                                completion_length=length)
        return Evaluation(-mean, reward=event)


class _LogitsThrough(torch.nn.Module):
    """The model's ``lm_head`` while sampling out of core: the logits by the head's loss module,
    so the engine's hook on that module (the head unit's last) releases the head each token."""

    def __init__(self, head_loss: torch.nn.Module) -> None:
        super().__init__()
        self.head_loss = head_loss

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_loss(hidden, None)


def _std(x: torch.Tensor) -> torch.Tensor:
    """The standard deviation ignoring NaNs (0 below two values)."""
    x = x[~torch.isnan(x)]
    return x.std() if x.numel() > 1 else torch.zeros(())
