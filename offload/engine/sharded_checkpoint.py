"""Checkpoints of an out-of-core run across ranks, with ``torch.distributed.checkpoint`` (DCP).

A unit at a time (one DCP checkpoint per unit, in its own folder), so neither the model nor
its state is ever whole in RAM. Each optimizer-state kind of a unit is saved in the *shard
space* of ``sharding.py``, as a tensor of ``[rows, PIECE_ALIGN / ratio]`` (``ratio``: parameter
elements per state element) whatever the world size: each rank writes its rows — a DTensor
sharded on dim 0 over the ranks, ``torch.chunk``'s cut, which is exactly each rank's range —
and DCP reads any rows back into any other cut. So a checkpoint saved by 2 ranks loads on 1
(or the other way round) and training goes on with the same state. Kinds kept whole per
tensor (a step count) and the weights (which every rank holds) are plain tensors, written
once. The atomic commit (a ``.tmp`` folder renamed, ``COMPLETE``) is the caller's
(``training/checkpoint/files.py``: rank 0 renames after a barrier).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import Ranks
from .sharding import Shard
from .unit_sizes import MASTER_DTYPE, PIECE_ALIGN
from .units import WEIGHTS, Unit

if TYPE_CHECKING:  # pragma: no cover
    from .engine import OutOfCoreEngine


def _ratios(unit: Unit, optimizer: Any) -> dict[str, int]:
    """Per state kind, parameter elements per state element (0: kept whole per tensor)."""
    if unit.layout.ratios:
        return unit.layout.ratios
    out: dict[str, int] = {}
    group = optimizer.param_groups[0]
    for k in unit.train_slots:
        slot = unit.slots[k]
        master = "master" in unit.layout.states[k]
        meta = torch.empty(slot.shape, dtype=MASTER_DTYPE if master else slot.param.dtype, device="meta")
        own = optimizer.elementwise_state(meta, group)
        if own is None:
            raise ValueError(f"optimizer {type(optimizer).__name__} is not element-wise: "
                             "its state cannot be saved in the shard space")
        out.update({"master": 1, **own} if master else own)
    return out


def _shard(unit: Unit) -> Shard:
    return unit.shard or Shard.of(unit, Ranks())


def _rows(shard: Shard) -> int:
    """Rows of PIECE_ALIGN elements in the unit's shard space (the same at every world size)."""
    return sum(-(-n // PIECE_ALIGN) for n in shard.numels.values())


def _kind_tensor(unit: Unit, kind: str, ratio: int, flat: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``kind`` in the shard space, [rows, PIECE_ALIGN / ratio], from the
    kind's flat buffer (zeros where a tensor has no such state, and in the padding)."""
    shard = _shard(unit)
    width, lo_row = PIECE_ALIGN // ratio, shard.lo // PIECE_ALIGN
    rows = max(0, min(shard.length // PIECE_ALIGN, _rows(shard) - lo_row))
    out = torch.zeros(rows * width, dtype=flat.dtype)
    for k, lo, _hi, at, n in _spans(unit, kind, ratio, shard):
        out[at:at + n] = flat[unit.layout.states[k][kind].offset + lo // ratio:][:n]
    return out.view(rows, width)


def _spans(unit: Unit, kind: str, ratio: int, shard: Shard) -> list[tuple[int, int, int, int, int]]:
    """(slot, lo, hi, local index, count) of ``kind``'s elements this rank owns."""
    return [(k, lo, hi, shard.at(k, lo) // ratio, -(-hi // ratio) - lo // ratio)
            for k, lo, hi in shard.spans if kind in unit.layout.states[k]]


def _whole(unit: Unit, kind: str, flat: torch.Tensor) -> torch.Tensor:
    """A kind kept whole per tensor, as every rank should have it: each tensor's value from the
    rank owning its first element (a rank that owns none of a tensor never advanced it)."""
    import torch.distributed as dist

    if unit.shard is None:
        return flat
    shard, out = unit.shard, torch.zeros_like(flat)
    for k, base in shard.bases.items():
        if kind in unit.layout.states[k] and base // shard.length == shard.rank:
            s = unit.layout.states[k][kind]
            out[s.offset:s.offset + s.shape.numel()] = flat[s.offset:s.offset + s.shape.numel()]
    dist.all_reduce(out)  # one rank adds each value to zeros: exact
    return out


def _state_dict(engine: OutOfCoreEngine, unit: Unit, mesh: Any) -> dict[str, Any]:
    """What DCP saves of one unit: weights per parameter, each state kind in the shard space."""
    from torch.distributed.tensor import DTensor, Shard as Dim

    mem, sd = engine.mem, {}
    weights = mem.weights(unit.index)
    for slot in unit.slots:
        sd[f"{slot.name}"] = unit.view(weights, slot).clone()
    ratios = _ratios(unit, engine.optimizer)
    for kind in unit.layout.kinds():
        flat = mem.state(unit.index, kind)
        if not ratios.get(kind):
            sd[f"state.{kind}"] = _whole(unit, kind, flat)
            continue
        local = _kind_tensor(unit, kind, ratios[kind], flat)
        if mesh is None:
            sd[f"state.{kind}"] = local
        else:
            shape = torch.Size([_rows(unit.shard), local.shape[1]])
            sd[f"state.{kind}"] = DTensor.from_local(local, mesh, [Dim(0)], run_check=False, shape=shape,
                                                     stride=(local.shape[1], 1))
    return sd


def _mesh(engine: OutOfCoreEngine) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not any(u.shard for u in engine.units):
        return None
    return init_device_mesh("cpu", (dist.get_world_size(),))


def save_sharded(engine: OutOfCoreEngine, path: str | Path) -> None:
    """Save an out-of-core engine's weights and optimizer state under ``path``, one DCP
    checkpoint per unit (``path/<unit name>``); every rank calls it (collectives inside).

    Args:
        engine: an ``OutOfCoreEngine`` (sharded over ranks, or one rank's).
        path: a folder (the caller's ``step_X.tmp``).
    """
    import torch.distributed.checkpoint as dcp

    mesh = _mesh(engine)
    engine.mem.flush()
    for unit in engine.units:
        dcp.save(_state_dict(engine, unit, mesh), checkpoint_id=str(Path(path) / unit.name))


def load_sharded(engine: OutOfCoreEngine, path: str | Path) -> None:
    """Load what :func:`save_sharded` saved, at this engine's world size (any: the state is
    resharded), into the engine's store; every rank calls it.

    Args:
        engine: an ``OutOfCoreEngine`` built like the one that saved (same model, optimizer).
        path: the folder :func:`save_sharded` wrote.
    """
    import torch.distributed.checkpoint as dcp

    mesh = _mesh(engine)
    mem = engine.mem
    for unit in engine.units:
        sd = _state_dict(engine, unit, mesh)  # the right shapes (and this rank's shards) to read into
        dcp.load(sd, checkpoint_id=str(Path(path) / unit.name))
        numel, dtype = unit.layout.flat[WEIGHTS]
        weights = torch.zeros(numel, dtype=dtype)
        for slot in unit.slots:
            unit.view(weights, slot).copy_(sd[slot.name])
        mem.overwrite(unit.index, WEIGHTS, weights)
        ratios = _ratios(unit, engine.optimizer)
        for kind in unit.layout.kinds():
            value = sd[f"state.{kind}"]
            numel, dtype = unit.layout.flat[kind]
            flat = torch.zeros(numel, dtype=dtype)
            if not ratios.get(kind):
                flat.copy_(value)
            else:
                local = (value.to_local() if mesh is not None else value).reshape(-1)
                for k, lo, _hi, at, n in _spans(unit, kind, ratios[kind], _shard(unit)):
                    flat[unit.layout.states[k][kind].offset + lo // ratios[kind]:][:n] = local[at:at + n]
            mem.overwrite(unit.index, kind, flat)
