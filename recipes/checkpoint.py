"""Atomic, resumable checkpoints of a training run, in memory or out of core.

Layout of ``OUTPUT/checkpoints``::

    step_000040/            one complete checkpoint (never modified once renamed)
        model.safetensors   trainable state (all weights for full fine-tuning in memory;
                            the adapters for LoRA; empty for a full fine-tune out of core)
        optimizer.pt        optimizer.state_dict() (empty out of core)
        trainer.pt          step, RNG states, data position, run facts
        units/              out of core only: one ``<unit>.safetensors`` per unit (its
                            weights ``w`` and each optimizer-state kind) and ``units.json``
        COMPLETE            written last: xxh64 of every file; a directory without it
                            is never loaded, and a file whose digest differs is an error
    latest                  text file naming the newest complete checkpoint

A checkpoint is written into ``step_X.tmp``, each file fsynced, then renamed
and ``latest`` replaced atomically, so a kill at any moment (Ctrl-C included)
leaves the previous checkpoint intact and loadable.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import xxhash
from safetensors.torch import load_file, save_file

from .._faults import fault_point
from ..errors import CheckpointError
from ..offload.device import cuda_rng_state, set_cuda_rng_state
from ..offload.units import WEIGHTS

_DIR = "checkpoints"
_LATEST = "latest"
_COMPLETE = "COMPLETE"


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (Python, NumPy, torch CPU, CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    cuda = cuda_rng_state()
    if cuda is not None:
        state["cuda"] = cuda
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    set_cuda_rng_state(state.get("cuda"))


def _digest(path: Path) -> str:
    """xxh64 of a file, read in 8 MiB pieces (~10 GB/s: negligible next to the write)."""
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold: parameters that train (deduplicated for tied weights)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[name] = p.detach().contiguous()
    return out


def save_checkpoint(output_dir: str | Path, step: int, model_state: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any], trainer_state: dict[str, Any],
                    keep: int = 2, write_extra: Callable[[Path], None] | None = None) -> Path:
    """Write one checkpoint atomically and prune old ones.

    Args:
        output_dir: the run's output directory.
        step: the number of optimizer steps done.
        model_state: name -> tensor (see :func:`trainable_state`).
        optimizer_state: ``optimizer.state_dict()``.
        trainer_state: everything else needed to resume (picklable).
        keep: how many complete checkpoints to keep (>= 1).
        write_extra: writes more files into the (temporary) checkpoint directory,
            e.g. the unit files of an out-of-core run; they are checksummed too.

    Returns:
        The checkpoint directory.
    """
    root = Path(output_dir) / _DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(model_state, str(tmp / "model.safetensors"))
    fault_point("checkpoint_file")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    fault_point("checkpoint_file")
    torch.save(trainer_state, tmp / "trainer.pt")
    fault_point("checkpoint_file")
    if write_extra is not None:
        write_extra(tmp)
    files = sorted(f for f in tmp.rglob("*") if f.is_file())
    digests = {str(f.relative_to(tmp)): _digest(f) for f in files}
    (tmp / _COMPLETE).write_text(json.dumps({"step": step, "xxh64": digests}))
    for f in [*files, tmp / _COMPLETE]:
        _fsync(f)
    if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fault_point("checkpoint_commit")
    latest_tmp = root / (_LATEST + ".tmp")
    latest_tmp.write_text(final.name)
    _fsync(latest_tmp)
    os.replace(latest_tmp, root / _LATEST)
    _fsync(root)
    complete = sorted(d for d in root.glob("step_*") if d.is_dir() and (d / _COMPLETE).exists()
                      and not d.name.endswith(".tmp"))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None when it has none."""
    root = Path(output_dir) / _DIR
    pointer = root / _LATEST
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / _COMPLETE).is_file():
            return cand
    # `latest` missing or stale: fall back to the newest complete directory.
    complete = sorted(d for d in root.glob("step_*") if (d / _COMPLETE).is_file()
                      and not d.name.endswith(".tmp"))
    return complete[-1] if complete else None


def load_checkpoint(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Returns:
        (model_state, optimizer_state, trainer_state).

    Raises:
        CheckpointError: a missing, incomplete or unreadable checkpoint.
    """
    d = Path(ckpt_dir)
    if not (d / _COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {str(d)!r} is incomplete (no {_COMPLETE} marker); "
                              "resume from an earlier one or start over with --overwrite")
    try:
        expected = json.loads((d / _COMPLETE).read_text())["xxh64"]
    except (ValueError, KeyError):
        raise CheckpointError(f"checkpoint {str(d)!r} has a damaged {_COMPLETE} marker; "
                              "delete the directory to resume from the previous checkpoint") from None
    for name, digest in expected.items():
        f = d / name
        if not f.is_file() or _digest(f) != digest:
            raise CheckpointError(f"checkpoint file {str(f)!r} is missing or corrupt (checksum mismatch); "
                                  "delete its directory to resume from the previous checkpoint")
    try:
        model_state = load_file(str(d / "model.safetensors"))
        optimizer_state = torch.load(d / "optimizer.pt", weights_only=False)
        trainer_state = torch.load(d / "trainer.pt", weights_only=False)
    except Exception as e:  # corrupt or truncated file: name it, never continue silently
        raise CheckpointError(f"checkpoint {str(d)!r} is unreadable ({type(e).__name__}: {e}); "
                              "delete it to resume from the previous one") from None
    return model_state, optimizer_state, trainer_state


def save_units(om: Any, directory: str | Path) -> None:
    """Write every unit's newest weights and optimizer state of an out-of-core run.

    One safetensors file per unit, read out of the store one unit at a time, so the
    memory needed is one unit's whatever the size of the model. A state streamed in
    pieces is saved joined: the checkpoint does not depend on the split.

    Args:
        om: the run's ``OutOfCoreEngine`` (``offload_model``).
        directory: where the files go (created; ``units/`` inside a checkpoint).
    """
    mem = om.mem
    mem.flush()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for unit in om.units:
        tensors = {kind: mem.state(unit.index, kind) for kind in (WEIGHTS, *mem.kinds(unit.index))}
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(d / f"{unit.name}.safetensors"))
        fault_point("checkpoint_file")
    (d / "units.json").write_text(json.dumps([u.name for u in om.units]))


def load_units(om: Any, directory: str | Path) -> None:
    """Replace every unit's weights and optimizer state with those :func:`save_units` wrote.

    Args:
        om: the run's ``OutOfCoreEngine`` (``offload_model``) (same model and optimizer as the saved run).
        directory: the ``units/`` directory of a checkpoint.

    Raises:
        CheckpointError: files missing, or not of this model / optimizer.
    """
    d = Path(directory)
    names = [u.name for u in om.units]
    try:
        saved = json.loads((d / "units.json").read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{str(d)!r} holds no out-of-core checkpoint (units.json missing or damaged)") from None
    if saved != names:
        raise CheckpointError(f"{str(d)!r} was saved from another model ({len(saved)} units, "
                              f"this one has {len(names)}); resume with the same --model")
    mem = om.mem
    for unit in om.units:
        tensors = load_file(str(d / f"{unit.name}.safetensors"))
        for kind in (WEIGHTS, *mem.kinds(unit.index)):
            shape, dtype = mem.kind_layout(unit.index, kind)
            t = tensors.get(kind)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                raise CheckpointError(f"{unit.name}.{kind} in {str(d)!r} does not match this run's "
                                      "optimizer state; resume with the same --optim and --model")
            mem.overwrite(unit.index, kind, t)
