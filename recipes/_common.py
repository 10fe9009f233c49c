"""Pieces every recipe shares: the output directory, memory readings, eval, export.

Kept out of the recipe scripts so that each script reads top to bottom as
setup → train → cleanup without bookkeeping in the way.
"""
from __future__ import annotations

import math
import os
import resource
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from ..errors import CheckpointError, ConfigError
from .config import FinetuneConfig, load_config, save_config

_RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
# Fields a resumed run must share with the run it continues (others, such as
# max_steps or eval_every, may change).
_RUN_DEFINING = ("model", "data", "data_max_bytes", "val_fraction", "seq_len", "method", "optim",
                 "optim_args", "batch_size", "grad_accum", "seed", "dtype", "lora_r", "lora_alpha",
                 "lora_targets", "offload")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    return _DTYPES[name]


def prepare_output_dir(config: FinetuneConfig) -> Path:
    """Create (or, for a resume, check) the output directory and write config.yaml.

    Raises:
        ConfigError: the directory holds another run and neither resume nor overwrite was asked.
        CheckpointError: resume was asked but the directory has no run to resume.
    """
    out = Path(config.output)
    holds_run = out.is_dir() and any((out / m).exists() for m in _RUN_MARKERS)
    if config.resume:
        if not holds_run or not (out / "config.yaml").is_file():
            raise CheckpointError(f"--resume {config.resume!r}: no run found there "
                                  "(expected config.yaml and checkpoints/); check the path")
        saved = load_config(out / "config.yaml", resume=None, overwrite=True)
        for key in _RUN_DEFINING:
            if getattr(saved, key) != getattr(config, key):
                raise CheckpointError(
                    f"--resume {config.resume!r}: {key}={getattr(config, key)!r} differs from the "
                    f"run's {key}={getattr(saved, key)!r}; drop it, or start a new run with another --output")
    elif holds_run:
        if not config.overwrite:
            raise ConfigError(f"output directory {str(out)!r} already holds a run; pass --resume "
                              f"{str(out)!r} to continue it, --overwrite to replace it, or another --output")
        for m in (*_RUN_MARKERS, "final", "loss_curve.png"):
            p = out / m
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    save_config(config, out / "config.yaml")
    return out


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads for torch (0 = every core)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def ram_total_bytes() -> int:
    return psutil.virtual_memory().total


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def evaluate(loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], dataset: Any,
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


def export_hf(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    LoRA adapters (peft) are merged into the base weights first; a QLoRA base is
    dequantized first and the merged model saved in its compute dtype.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if _is_4bit(model):  # QLoRA: merging into NF4 would round the update away
        _save_dequantized_merged(model, tmp)
    else:
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _is_4bit(model: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


def _save_dequantized_merged(model: torch.nn.Module, directory: Path) -> None:
    """Save ``model`` (a peft model over bitsandbytes NF4 layers) as a plain HF model:
    each NF4 weight dequantized, the LoRA delta added in full precision."""
    import copy

    from safetensors.torch import save_file

    from ..models import lora_deltas, plain_name

    deltas = lora_deltas(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = base.config.dtype if isinstance(base.config.dtype, torch.dtype) else torch.float32
    state = {}
    for name, p in model.named_parameters():
        if p.requires_grad:  # the adapters: merged into their base weight below
            continue
        with torch.no_grad():
            t = _dequantized(p) if hasattr(p, "quant_state") else p.detach().float()
            if id(p) in deltas:
                t = t + deltas[id(p)]
        state[plain_name(name)] = t.to(dtype).contiguous()
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _dequantized(p: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes NF4 weight in fp32. On the CPU, bitsandbytes repacks a layer's codes for
    its AVX512 kernel after the first forward; undo that first (bitsandbytes' own inverse,
    which ``Params4bit.cuda()`` uses too)."""
    import copy

    import bitsandbytes.functional as F

    data, state = p.data, p.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        # the inverse rewrites the state's fields: give it a copy (the layer keeps working)
        data, state = F._convert_weight_packed_for_cpu_inverse(data, copy.copy(state))
        if state.absmax.dim() == 2:  # the repacking stored absmax as [blocks per row, rows]
            state.absmax = state.absmax.T.reshape(-1).float()
    return F.dequantize_4bit(data, state).float()
