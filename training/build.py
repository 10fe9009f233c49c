"""What a recipe builds before it trains: the LoRA adapters (and the ZO recipe's model with
them), the optimizer, the memory plan and the out-of-core engine the plan describes
(``full_finetune.FullFinetune.setup`` and the benchmarks call these)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..dtypes import EXACT
from ..errors import ConfigError
from ..offload.distributed import Ranks, from_env
from .config import FinetuneConfig
from .distributed.across_ranks import rank_swap_dir


def with_lora(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters on ``cfg.lora_targets`` (seeded; see ``models.add_lora``)."""
    from ..models import add_lora

    return add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                    targets=cfg.lora_targets, seed=cfg.seed)


def load_zo_model(spec: str, dtype: str, seed: int, lora: dict[str, Any] | None):
    """The model a ZO run trains: the base model, plus LoRA adapters when asked (seeded init).

    Returns:
        ``(model, tokenizer, peft_model)``; with LoRA ``model`` is the base causal LM
        with the adapters injected (only they require grad) and ``peft_model`` its
        peft wrapper (for merging at export), else ``peft_model`` is None.
    """
    from ..models import load_model

    model, tok = load_model(spec, dtype=getattr(torch, dtype))
    model.config.use_cache = False
    if not lora:
        return model, tok, None
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # the adapters' init must be the same at export time
    wrapped = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                               target_modules=list(lora["targets"])))
    return wrapped.get_base_model(), tok, wrapped


def optimizer_for_config(cfg: FinetuneConfig, params: list[torch.nn.Parameter], streaming: bool = False
                         ) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.optim`` over ``params``, with the config's hyperparameters and
    precision (``outcore.optim.build_optimizer`` builds one from a name and keyword arguments).

    In memory, ``adamw`` is torch's fused AdamW: the reference. Streamed
    (``streaming=True``), it is ``outcore.optim.AdamW``, whose per-unit update is
    the same kernel, so both give the same bits. The memory-lean optimizers
    come from ``outcore.optim``; ``precision=bf16-lean`` wraps any of them (``optim/lean.py``).
    """
    common = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optim == "adamw" and not streaming and cfg.precision == EXACT:
        return torch.optim.AdamW(params, betas=cfg.betas, eps=cfg.eps, fused=True, **common)
    from .. import optim as oc_optim

    return oc_optim.with_precision(oc_optim.build_optimizer(cfg.optim, params, betas=cfg.betas, eps=cfg.eps,
                                                            **common, **cfg.optim_args), cfg.precision, cfg.seed)


def check_offload_supported(cfg: FinetuneConfig) -> None:
    """Raise ConfigError for combinations the out-of-core engine does not run yet.

    (Every dtype runs: out of core, ``bfloat16`` / ``float16`` mean mixed precision,
    16-bit compute with fp32 master weights and optimizer state in the state tier.)
    """
    if cfg.zeroth_order:
        raise ConfigError(f"offload={cfg.offload!r} with method={cfg.method!r} is not supported: "
                          "use --method full|lora|qlora")


def plan_this_run(cfg: FinetuneConfig, model: torch.nn.Module):
    """The MemoryPlan of this run: ``planner.plan_for_config`` with this machine's probe (budgets from
    --device-mem / --host-mem, the swap directory's disk) and the launcher's world size."""
    from ..offload.store import probe_hardware
    from ..planner import plan_for_config

    probe = probe_hardware(swap_dir_of(cfg, Path(cfg.output)).parent, measure=False)
    return plan_for_config(cfg, model, probe=probe, world=from_env().world)


def _nvme_during_steps(plan: Any) -> int:
    """What the plan puts on NVMe only during the steps (spilled gradients), with its padding
    bound: the room the swap file keeps past the units' extents."""
    nvme = plan.tier_bytes.get("NVME", {})
    return nvme["grads"] + nvme.get("alignment", 0) if nvme.get("grads") else 0


def swap_dir_of(cfg: FinetuneConfig, out: Path) -> Path:
    """This rank's swap directory: ``--swap-dir`` or OUTPUT/swap (``rankR`` under it with several ranks)."""
    return rank_swap_dir(Path(cfg.swap_dir) if cfg.swap_dir else out / "swap", from_env())


def offload_from_plan(cfg: FinetuneConfig, model: torch.nn.Module, optimizer: Any, plan: Any, out: Path,
                      head_loss: torch.nn.Module | None = None,
                      fill: Callable[[str, torch.Tensor], None] | None = None, ranks: Ranks | None = None,
                      device: torch.device | None = None):
    """Move the model's weights and optimizer state to the tiers ``plan`` chose.

    ``fill(name, out)`` reads a weight of a meta-device model (see ``load_model_lazily``);
    ``device`` is where it computes (default: ``cfg.device``).
    With several ``ranks`` a full fine-tune's optimizer state is sharded across them
    (``offload/engine/sharding.py``); LoRA's resident adapters are not
    (``distributed.across_ranks.data_parallel``).
    """
    from ..bytesize import parse_bytes
    from ..models import plain_name
    from ..offload.engine import offload_model
    from ..offload.modes import CPU, NVME
    from ..offload.store import Tier

    home = {Tier.DEVICE: Tier.HOST, Tier.HOST: Tier.HOST, Tier.NVME: Tier.NVME}
    homes = [(home[u.weights], home[u.state or u.weights], home[u.grads or u.state or u.weights]) for u in plan.units]
    # kept gradients are spilled to their home as each unit's complete when the plan puts them
    # on NVMe, or in HOST beside a state that streams from NVMe (the update reads them there)
    spill = any(g is Tier.NVME or (g is Tier.HOST and s is Tier.NVME) for _, s, g in homes) and plan.grads_kept
    mode = NVME if any(Tier.NVME in h for h in homes) else CPU
    head_modules = [] if head_loss is None else [head_loss]
    return offload_model(model, optimizer, offload=mode, swap_dir=swap_dir_of(cfg, out), head_modules=head_modules,
                         prefetch=max(1, plan.prefetch_depth), max_grad_norm=cfg.max_grad_norm,
                         grad_accum=cfg.grad_accum, homes=homes,
                         resident_trainable=cfg.uses_adapters, quantize_frozen=cfg.quantizes_base,
                         spill_grads=spill,
                         device_bytes=parse_bytes(cfg.device_mem) if cfg.device_mem else None,
                         host_bytes=parse_bytes(cfg.host_mem) if cfg.host_mem else None,
                         nvme_reserve=plan.tier_total(Tier.NVME) if mode == NVME else 0,
                         nvme_keep=_nvme_during_steps(plan),
                         ranks=None if cfg.uses_adapters else ranks, device=device or cfg.device,
                         update_on=cfg.update_on,
                         init_weights=None if fill is None else (lambda slot, t: fill(plain_name(slot.name), t)))
