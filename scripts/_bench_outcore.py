"""The model side of scripts/bench_step.py: identical weights for every mode, and outcore's
out-of-core trainer built exactly as a user gets it (the full-finetune recipe's path).

- ``default``: the packaged SmolLM2-135M GGUF. In-memory and DeepSpeed load it whole
  through ``outcore.models.load_model`` (its dequantized safetensors cache); outcore
  builds it on the meta device with ``load_model_lazily`` and reads each unit's
  weights from the same files as the unit is stored: the same fp32 values.
- random models (``tiny``, ``smol-1.7b-random``): every parameter is a deterministic
  function of (seed, name) (:func:`random_fill`), so a model built whole and one
  filled unit by unit hold the same bits without writing gigabytes of weights to disk.

The outcore trainer (:class:`OutcoreTrainer`) goes through the recipe's own builders
(``optimizer_for_config(streaming=True)``, ``plan_this_run``, ``offload_from_plan``) with the
chunked LM-head loss (``CausalLMHeadLoss``, no [tokens, vocab] logits) and the plan's
activation policy, so the whole fp32 model never sits in its process's RAM.
"""
from __future__ import annotations

import tempfile
import zlib
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

#: Initializer scale of random models (LlamaConfig's initializer_range).
INIT_STD = 0.02


def random_fill(seed: int) -> Callable[[str, torch.Tensor], None]:
    """``fill(name, out)``: parameter ``name`` of a random model, written into ``out``.

    Norm weights are ones, everything else N(0, ``INIT_STD``) from a generator seeded by
    (seed, name): the value does not depend on the order or the process that asks.
    """
    def fill(name: str, out: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            out.fill_(1.0)
            return
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        out.normal_(0.0, INIT_STD, generator=g)
    return fill


def meta_model(config: Any, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A causal LM of ``config`` on the meta device (computed buffers, e.g. rotary, on the CPU)."""
    from transformers import AutoModelForCausalLM

    from outcore.models._lazy import materialize_buffers

    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    materialize_buffers(model, config)
    return model


def materialize(model: torch.nn.Module, fill: Callable[[str, torch.Tensor], None]) -> torch.nn.Module:
    """Give every meta parameter of ``model`` real CPU storage filled by ``fill`` (tied weights once)."""
    for name, p in model.named_parameters():  # tied parameters are listed once
        real = torch.empty(p.shape, dtype=p.dtype)
        fill(name, real)
        torch.utils.swap_tensors(p, torch.nn.Parameter(real, requires_grad=p.requires_grad))
    return model


def full_model(kind: str, config: Any, seed: int) -> torch.nn.Module:
    """The whole fp32 model in RAM (the in-memory and DeepSpeed modes)."""
    if kind == "default":
        from outcore.models import load_model

        model, _ = load_model("default", dtype=torch.float32, tokenizer=False)  # the parent tokenizes
    else:
        model = materialize(meta_model(config), random_fill(seed))
    model.config.use_cache = False  # the KV cache is for generation
    return model.train()


def lazy_model(kind: str, config: Any, seed: int, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.nn.Module, Callable[[str, torch.Tensor], None]]:
    """The model on the meta device and ``fill(name, out)`` for its weights (the outcore modes)."""
    if kind == "default":
        from outcore.models import load_model_lazily

        model, _, fill = load_model_lazily("default", dtype=dtype, tokenizer=False)
    else:
        model, fill = meta_model(config, dtype), random_fill(seed)
    model.config.use_cache = False
    return model.train(), fill


def run_config(*, offload: str, optim: str, seq_len: int, batch_size: int, hyper: dict[str, Any], work: Path,
               activations: str = "keep", dtype: str = "float32", seq_tile: "int | str" = "auto", seed: int = 0):
    """The ``FinetuneConfig`` an :class:`OutcoreTrainer` runs (and plans) with: no clipping, no
    accumulation, its swap files and output under ``work``."""
    from outcore.training.config import FinetuneConfig

    return FinetuneConfig(offload=offload, optim=optim, seq_len=seq_len, batch_size=batch_size,
                          max_grad_norm=0.0, grad_accum=1, seed=seed, dtype=dtype,
                          activations=activations, seq_tile=seq_tile, swap_dir=str(work / "swap"),
                          output=str(work / "run"), ui="none", export=False,
                          lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                          weight_decay=hyper["weight_decay"])


class OutcoreTrainer:
    """outcore's out-of-core full fine-tune of one model, built through the recipe's builders.

    Args:
        kind, config, seed: the model (see :func:`lazy_model`).
        offload: ``"nvme"`` or ``"cpu"`` (the recipe's ``offload``).
        optim: ``"adamw"`` or ``"adamw8bit"`` (outcore's streamed optimizers).
        seq_len, batch_size: the workload the plan is made for.
        hyper: ``lr``, ``betas``, ``eps``, ``weight_decay``.
        work_dir: a directory for the run's swap files (removed by :meth:`close`).
        activations: the recipe's activation policy (``keep`` is its default).
        dtype: the compute dtype (``bfloat16``: fp32 masters in the state tier, as the recipe does).
        budgets: measured ``Budgets`` to plan with (None: the recipe's own plan, speeds not measured).
        seq_tile: tokens per tile (``auto``, 0 = untiled, or a count), as the recipe's ``seq_tile``.

    No clipping (``max_grad_norm=0``) and no accumulation, as in the other modes: the
    engine updates each unit during the backward (step-in-backward).
    """

    def __init__(self, kind: str, config: Any, seed: int, *, offload: str, optim: str, seq_len: int,
                 batch_size: int, hyper: dict[str, Any], work_dir: str, activations: str = "keep",
                 dtype: str = "float32", budgets: Any = None, seq_tile: "int | str" = "auto"):
        self.work = Path(tempfile.mkdtemp(prefix="bench_outcore_", dir=work_dir))
        self.lr = hyper["lr"]
        try:
            self._build(kind, config, seed, offload, optim, seq_len, batch_size, hyper, activations, dtype,
                        budgets, seq_tile)
        except BaseException:  # e.g. the plan does not fit: leave no swap files behind
            import shutil

            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def _build(self, kind: str, config: Any, seed: int, offload: str, optim: str, seq_len: int,
               batch_size: int, hyper: dict[str, Any], activations: str, dtype: str, budgets: Any,
               seq_tile: "int | str") -> None:
        from outcore.dtypes import torch_dtype
        from outcore.kernels.linear_cross_entropy import CausalLMHeadLoss
        from outcore.models import model_parts
        from outcore.training.build import (check_offload_supported, offload_from_plan, optimizer_for_config,
                                           plan_this_run)

        cfg = run_config(offload=offload, optim=optim, seq_len=seq_len, batch_size=batch_size, hyper=hyper,
                         work=self.work, activations=activations, dtype=dtype, seq_tile=seq_tile, seed=seed)
        check_offload_supported(cfg)
        self.model, fill = lazy_model(kind, config, seed, torch_dtype(dtype))
        if budgets is None:
            self.plan = plan_this_run(cfg, self.model)
        else:  # the plan `outcore plan` prints after `outcore doctor` measured the machine
            from outcore.planner import plan_for_config

            self.plan = plan_for_config(cfg, self.model, budgets=budgets)
        # The recipe's loss: the decoder's hidden states into the chunked LM-head loss.
        self.decoder = self.model.model
        self.head_loss = CausalLMHeadLoss(model_parts(self.model).lm_head)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optimizer_for_config(cfg, params, streaming=True)
        self.offloaded = offload_from_plan(cfg, self.model, self.optimizer, self.plan, self.work,
                                           self.head_loss, fill)
        self.activations = None
        if self.plan.activations != "keep" or self.plan.seq_tile:
            from outcore.activations import apply_activation_policy

            to_disk = self.plan.activations in ("offload", "recompute_nvme")
            offloads = to_disk and self.offloaded.store.has_tier("nvme")
            store = self.offloaded.store if offloads else None  # as the recipe does
            self.activations = apply_activation_policy(self.model, self.plan.activations, store=store,
                                                       prefetch_depth=self.plan.activations_read_ahead,
                                                       seq_tile=self.plan.seq_tile)

    def _loss(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.decoder(input_ids=ids).last_hidden_state
        return self.head_loss(hidden, ids)

    def step(self, ids: torch.Tensor) -> float:
        """One optimizer step on ``ids`` [batch, seq]; returns the loss."""
        loss = self.offloaded.train_step(self._loss, [ids], self.lr)
        return float(loss)  # a host read: every unit's update has run when it returns

    def tier_stats(self) -> dict[str, Any]:
        """The store's per-tier bytes held / budget / moved so far."""
        return {name: {"held_bytes": s.held_bytes, "budget_bytes": s.budget_bytes,
                       "read_bytes": s.read_bytes, "written_bytes": s.written_bytes}
                for name, s in self.offloaded.store.tier_stats().items()}

    def close(self) -> None:
        """Finish writes, free the arenas, remove the swap directory."""
        import shutil

        try:
            if self.activations is not None:
                self.activations.remove()
            self.offloaded.close()
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
