"""Export a run's latest checkpoint as a Hugging Face directory (``outcore export``).

A full or LoRA run's checkpoint holds its trainable tensors (in memory) or one
file per unit (out of core); a zeroth-order run holds its base weights and the
(seed, projected gradient) log, replayed here into the trained weights.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import CheckpointError
from . import _checkpoint as ckpt
from ._common import export_hf, torch_dtype
from .config import load_config


def export_run(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the trained model of ``run_dir`` to ``out_dir`` (default ``RUN/export``).

    Args:
        run_dir: an output directory of ``outcore finetune``.
        out_dir: where to write; replaced if it exists.

    Returns:
        The directory written.

    Raises:
        CheckpointError: no run or no complete checkpoint there, or a damaged one.
    """
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise CheckpointError(f"{str(run)!r} holds no outcore run (no config.yaml); pass a run's --output directory")
    cfg = load_config(run / "config.yaml", resume=None, overwrite=True)
    out = Path(out_dir) if out_dir is not None else run / "export"
    if cfg.method == "zo":
        from .zo_finetune import export_zo_run
        return export_zo_run(run, out)

    last = ckpt.latest_checkpoint(run)
    if last is None:
        raise CheckpointError(f"run {str(run)!r} has no complete checkpoint to export")
    model_state, _, _ = ckpt.load_checkpoint(last)  # verifies every file's checksum

    from ..models import load_model

    model, tokenizer = load_model(cfg.model, dtype=torch_dtype(cfg.dtype), quantize_4bit=cfg.method == "qlora")
    if cfg.method in ("lora", "qlora"):
        from .full_finetune import _with_lora
        model = _with_lora(model, cfg)
    named = dict(model.named_parameters())
    with torch.no_grad():
        if (last / "units").is_dir():  # out of core: each unit's flat weights, laid out as in training
            from ..offload.units import causal_lm_units
            for unit in causal_lm_units(model):
                flat = load_file(str(last / "units" / f"{unit.name}.safetensors"))["w"]
                for slot in unit.slots:
                    slot.param.copy_(unit.view(flat, slot))
        else:
            for name, t in model_state.items():
                named[name].copy_(t)
    return export_hf(model, tokenizer, out)
