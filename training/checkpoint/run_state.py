"""What a checkpoint holds of a run besides its optimizer's ``state_dict``: every RNG's state,
the tensors that train, and out of core each unit's weights and optimizer state.

``files.save_checkpoint`` writes them into its atomic checkpoint directory (the units through
its ``write_extra``, into ``units/``) and ``files.load_checkpoint`` verifies them before they
are read back here.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..._faults import fault_point
from ...errors import CheckpointError
from ...offload.device import rng_state as device_rng_state
from ...offload.device import set_rng_state as set_device_rng_state
from ...offload.engine import WEIGHTS

if TYPE_CHECKING:  # pragma: no cover
    from ...offload.engine import OutOfCoreEngine


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every RNG a training step may draw from (Python, NumPy, torch CPU, the compute ``device``'s)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    on_device = device_rng_state(device)
    if on_device is not None:
        state["cuda"] = on_device
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` captured (the device's state on the compute ``device``)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    set_device_rng_state(device, state.get("cuda"))


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold: parameters that train (deduplicated for tied weights)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[name] = p.detach().contiguous()
    return out


def save_units(om: OutOfCoreEngine, directory: str | Path) -> None:
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


def units_bytes(om: OutOfCoreEngine) -> int:
    """Bytes :func:`save_units` writes for an out-of-core run (every unit's weights and state)."""
    mem, total = om.mem, 0
    for unit in om.units:
        for kind in (WEIGHTS, *mem.kinds(unit.index)):
            shape, dtype = mem.kind_layout(unit.index, kind)
            total += math.prod(shape) * dtype.itemsize
    return total


def load_units(om: OutOfCoreEngine, directory: str | Path) -> None:
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
