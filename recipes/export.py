"""Hugging Face export: every recipe's trained model as a directory ``from_pretrained`` loads.

One writer, :func:`write_hf_dir`, takes the weights as an iterator of shards and
writes the directory atomically (``OUT.tmp``, then one rename): the shards, the
index json, the config, the generation config and the tokenizer. Its sources:

* :func:`export_hf` — a model in memory (full, LoRA, or QLoRA with its NF4 base
  dequantized), one shard;
* :func:`export_offloaded` — an out-of-core run, streamed out of the store one unit
  per shard, so the memory needed is one unit's, whatever the size of the model;
* :func:`export_run` — ``outcore export``: a run's latest checkpoint (a ZO run's log is
  replayed onto its base weights instead: :func:`export_zo_run`).

LoRA adapters are merged into their base weights by ``models.merge_lora`` in every
case; peft's name prefixes are dropped (``models.plain_name``).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file

from .._faults import fault_point
from ..errors import CheckpointError
from ..training import checkpoint as ckpt
from ..training.build import load_zo_model
from ..training.config import load_config

if TYPE_CHECKING:  # pragma: no cover
    from ..offload.engine import OutOfCoreEngine
    from ..offload.engine import Unit

Shard = dict[str, torch.Tensor]  # tensors by plain model name, written as one file


def write_hf_dir(out_dir: str | Path, shards: Iterable[Shard], model: torch.nn.Module, tokenizer: Any = None
                 ) -> Path:
    """Write a Hugging Face model directory atomically, one shard at a time.

    Args:
        out_dir: the directory to write; replaced if it exists, only once complete.
        shards: ``{name: tensor}`` dicts, each written as it arrives (a generator keeps one
            shard in memory at a time), named the Hugging Face way once they are all there:
            ``model.safetensors`` alone, else ``model-00001-of-000NN.safetensors``.
        model: the model the weights are of (a peft wrapper is looked through; it may
            be on the meta device): its config is saved as a copy, without a
            ``quantization_config`` (the weights written are plain) and with ``dtype``
            set to the weights' (as ``save_pretrained`` does), and its generation config.
        tokenizer: saved too when given.

    Returns:
        ``out_dir``.
    """
    from ..models import unwrap_peft

    base = unwrap_peft(model)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names: list[list[str]] = []  # each shard's tensor names, in order
    total, dtype = 0, None
    for i, tensors in enumerate(shards):
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / f"shard-{i}"), metadata={"format": "pt"})
        names.append(list(tensors))
        fault_point("export_shard")
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        dtype = dtype or next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(names):  # the count is known now: the names every HF tool expects
        file_name = "model.safetensors" if len(names) == 1 else f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        os.replace(tmp / f"shard-{i}", tmp / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype or config.dtype
    config.save_pretrained(tmp)
    for part in (getattr(base, "generation_config", None), tokenizer):
        if part is not None:
            part.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    fault_point("export_commit")
    os.replace(tmp, out)
    return out


def export_hf(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write a model held in memory as a Hugging Face directory (one ``model.safetensors``).

    LoRA adapters (peft) are merged into their base weights; a QLoRA base is
    dequantized first and written in its compute dtype. Tied weights are written
    once, under their first name, as ``save_pretrained`` does.

    Args:
        model: a causal LM, or a peft model over one.
        tokenizer: saved beside the weights (None: none).
        out_dir: the directory to write (replaced).

    Returns:
        ``out_dir``.
    """
    from ..models import is_adapter, merge_lora, plain_name, unwrap_peft

    config = unwrap_peft(model).config
    # a QLoRA base is written in the model's compute dtype (its quantization state may name another)
    compute_dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights come once (named_parameters dedups)
            if is_adapter(name):  # merged into its base weight below
                continue
            quantized = hasattr(p, "quant_state")
            # NF4: merge into the fp32 dequantized weight, else the update is rounded away
            t = merge_lora(model, name, _dequantized(p) if quantized else p.detach())
            tensors[plain_name(name)] = t.to(compute_dtype) if quantized else t
    return write_hf_dir(out_dir, [tensors], model, tokenizer)


def unit_weights(om: OutOfCoreEngine, unit: Unit) -> dict[str, torch.Tensor]:
    """One unit's parameters of an out-of-core run by model name, copied out of the store.

    Args:
        om: the run's ``OutOfCoreEngine`` (``offload_model``).
        unit: one of ``om.units``.

    Returns:
        ``{qualified name: tensor}`` (NF4 weights dequantized into the compute dtype).
    """
    return _by_name(unit, om.mem.weights(unit.index))


def _by_name(unit: Any, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameters of ``unit`` out of its ``flat`` weights, by qualified name (copies:
    safetensors writes no views of one buffer)."""
    return {s.name: unit.view(flat, s).clone() for s in unit.slots}


def export_offloaded(om: OutOfCoreEngine, model: torch.nn.Module, out_dir: str | Path,
                     tokenizer: Any = None) -> Path:
    """Write an out-of-core run's model as a Hugging Face directory, one shard per unit.

    Bounded memory: one unit's weights (and its LoRA deltas) at a time. A tied weight
    belongs to one unit only, so it is written once, as transformers expects.

    Args:
        om: the run's ``OutOfCoreEngine`` (``offload_model``).
        model: the model it trains (a peft model for LoRA: its adapters are merged).
        out_dir: the directory to write (replaced).
        tokenizer: saved beside the weights (None: none).

    Returns:
        ``out_dir``.
    """
    om.mem.flush()
    return write_hf_dir(out_dir, _unit_shards(om, model), model, tokenizer)


def _unit_shards(om: OutOfCoreEngine, model: torch.nn.Module) -> Iterator[Shard]:
    for unit in om.units:
        if unit.slots:
            yield _unit_shard(model, unit, unit_weights(om, unit))


def _unit_shard(model: torch.nn.Module, unit: Any, weights: dict[str, torch.Tensor]) -> Shard:
    """One unit's shard: its weights under their plain names, LoRA adapters merged."""
    from ..models import merge_lora, plain_name

    return {plain_name(n): merge_lora(model, n, t) for n, t in weights.items()}


def export_run(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the trained model of ``run_dir``'s latest checkpoint to ``out_dir`` (``outcore export``).

    A full or LoRA run's checkpoint holds its trainable tensors (in memory) or one
    file per unit (out of core); a zeroth-order run holds its base weights and the
    (seed, projected gradient) log, replayed into the trained weights.

    Args:
        run_dir: an output directory of ``outcore finetune``.
        out_dir: where to write (default ``RUN/export``); replaced if it exists.

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
    if cfg.zeroth_order:
        return export_zo_run(run, out)

    last = ckpt.latest_checkpoint(run)
    if last is None:
        raise CheckpointError(f"run {str(run)!r} has no complete checkpoint to export")
    model_state, _, _ = ckpt.load_checkpoint(last)  # verifies every file's checksum
    if (last / "units").is_dir() or (last / "units_dcp").is_dir():
        return _export_units(cfg, last, out)

    from ..models import load_model
    from ..dtypes import torch_dtype
    from ..training.build import with_lora

    model, tokenizer = load_model(cfg.model, dtype=torch_dtype(cfg.dtype), quantize_4bit=cfg.quantizes_base)
    if cfg.uses_adapters:
        model = with_lora(model, cfg)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in model_state.items():
            named[name].copy_(t)
    return export_hf(model, tokenizer, out)


def export_zo_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Replay a ZO run directory into full weights (what ``outcore export`` calls).

    The run directory holds ``zo_log.jsonl`` whose header names the base weights:
    ``{"base": {"kind": "safetensors", "path": "base.safetensors"}}`` (relative to
    the run directory; the result is ``out_dir/model.safetensors``) or
    ``{"base": {"kind": "model", "model": <what load_model accepts>}}`` (the result
    is a Hugging Face directory written by ``save_pretrained``).

    Args:
        run_dir: the run's output directory.
        out_dir: where to write the trained weights (created).

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: no log, a log without a base, or a base that cannot be read.
    """
    from ..optim.zo_replay import ZOLog, replay_into_

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    log = ZOLog.load(run_dir)
    if log.damaged:
        print(f"outcore: warning: {log.damaged}; exporting step {len(log.records)}", file=sys.stderr)
    base = log.header.get("base")
    if not base:
        raise CheckpointError(f"ZO log in {str(run_dir)!r} names no base weights; cannot export it")
    out_dir.mkdir(parents=True, exist_ok=True)
    if base["kind"] == "safetensors":
        path = run_dir / base["path"]
        if not path.is_file():
            raise CheckpointError(f"base weights {str(path)!r} of ZO run {str(run_dir)!r} are missing")
        sd = load_file(str(path))
        replay_into_(sd, log)
        save_file(sd, str(out_dir / "model.safetensors"))
        return out_dir
    if base["kind"] == "model":
        model, tok, wrapped = load_zo_model(base["model"], base.get("dtype", "float32"),
                                            int(log.header.get("seed", 0)), base.get("lora"))
        replay_into_(dict(model.named_parameters()), log)
        return export_hf(wrapped if wrapped is not None else model, tok, out_dir)
    raise CheckpointError(f"ZO log base kind {base['kind']!r} is unknown (expected safetensors or model)")


def _export_units(cfg: Any, last: Path, out: Path) -> Path:
    """Export an out-of-core full fine-tune's checkpoint (one file per unit: ``units/``, or one
    DCP checkpoint per unit of a sharded run: ``units_dcp/``) with bounded memory: the model is
    built on the meta device and each unit's weights go from the checkpoint to its shard, one
    unit at a time."""
    from ..models import load_model_lazily
    from ..offload.engine import WEIGHTS, causal_lm_units
    from ..dtypes import torch_dtype
    from ..training.checkpoint.dcp import sharded_unit_weights

    def weights(unit: Any) -> dict[str, torch.Tensor]:
        if (last / "units").is_dir():
            return _by_name(unit, load_file(str(last / "units" / f"{unit.name}.safetensors"))[WEIGHTS])
        return sharded_unit_weights(last, unit.name)

    model, tokenizer, _ = load_model_lazily(cfg.model, dtype=torch_dtype(cfg.dtype))
    shards = (_unit_shard(model, unit, weights(unit)) for unit in causal_lm_units(model) if unit.slots)
    return write_hf_dir(out, shards, model, tokenizer)


def _dequantized(p: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes NF4 weight in fp32. On the CPU, bitsandbytes repacks a layer's codes for
    its AVX512 kernel after the first forward; undo that first (bitsandbytes' own inverse,
    which ``Params4bit.cuda()`` uses too)."""
    import bitsandbytes.functional as F

    data, state = p.data, p.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        # the inverse rewrites the state's fields: give it a copy (the layer keeps working)
        data, state = F._convert_weight_packed_for_cpu_inverse(data, copy.copy(state))
        if state.absmax.dim() == 2:  # the repacking stored absmax as [blocks per row, rows]
            state.absmax = state.absmax.T.reshape(-1).float()
    return F.dequantize_4bit(data, state).float()


def resolve_model_or_run(spec: str | Path, scratch: str | Path | None = None
                         ) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """What to load for ``spec``: a model spec as it is, or an outcore run's trained model.

    A run directory (it holds ``config.yaml``) gives its ``final/`` model, unless a
    checkpoint is newer (a run resumed after it finished, or interrupted before): then
    that checkpoint, exported (``export_run``) into a temporary directory inside
    ``scratch`` (default: the run).

    Args:
        spec: a model spec (see ``models.load_model``) or a run's output directory.
        scratch: where the temporary directory goes (default: the run's directory).

    Returns:
        ``(model spec, temporary directory to remove when done, or None)``.

    Raises:
        CheckpointError: a run with no ``final/`` model and no complete checkpoint.
    """
    run = Path(str(spec)).expanduser()
    if not (run / "config.yaml").is_file():
        return str(spec), None
    final, last = run / "final", ckpt.latest_checkpoint(run)
    if (final / "config.json").is_file() and (last is None or final.stat().st_mtime >= last.stat().st_mtime):
        return str(final), None
    if last is None:
        raise CheckpointError(f"run {str(run)!r} has no final/ model and no complete checkpoint; "
                              "let it train to a checkpoint, or pass a model")
    temporary = tempfile.TemporaryDirectory(prefix="checkpoint-", dir=scratch or run)
    try:
        return str(export_run(run, Path(temporary.name) / "model")), temporary
    except BaseException:
        temporary.cleanup()
        raise
