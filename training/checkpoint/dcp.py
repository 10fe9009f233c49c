"""Checkpoints of a data-parallel run with ``torch.distributed.checkpoint`` (DCP), inside
``files.py``'s atomic protocol.

A run under torchrun writes, besides ``trainer.pt`` (rank 0's: the step, the data position and
the RNG states are the same on every rank), its model and optimizer state as one DCP
checkpoint in ``step_X.tmp/dcp/``: ``torch.distributed.checkpoint.state_dict.get_state_dict``
names every tensor by its parameter's name (not by ``id``), and ``dcp.save`` spreads the
writing over the ranks (a replicated tensor is written once, by one rank). In order:

1. rank 0 checks the free space, clears ``.tmp`` debris and creates ``step_X.tmp``
   (``files.save_checkpoint``), then tells every rank where (a broadcast);
2. every rank writes its share (``dcp.save``, collective: its last step is rank 0 writing
   ``.metadata``);
3. rank 0 fsyncs and digests every file into ``COMPLETE`` and renames ``step_X.tmp`` to
   ``step_X``; every rank hears the outcome (a broadcast), so all raise together.

A rank killed at any point leaves the previous checkpoint intact (``.tmp`` debris is never
read). Loading reads the files on each rank (``no_dist``): the state is a replica, so a
checkpoint written by 2 ranks resumes on 1 and one written by 1 rank (the single-process
format) on 2. ``files.load_checkpoint`` reads the model part too
(``files.dcp_model_state``), so ``outcore export`` of a distributed run is the one-rank export.

A full fine-tune out of core across ranks (its state sharded, ``offload/engine/sharding.py``) writes
``step_X/units_dcp/<unit>`` instead, one DCP checkpoint per unit in a world-independent shard
space (``offload/engine/sharded_checkpoint.py``), through the same protocol; it resumes at any number of
ranks (:func:`restore_units`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import CheckpointError, OutcoreError
from ...offload.distributed import Ranks
from ..distributed.across_ranks import broadcast_from_main
from .files import DCP_DIR, DCP_MODEL, is_distributed, load_dcp_in_process, save_checkpoint, tensor_bytes
from .run_state import load_units, trainable_state, units_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ...offload.engine import OutOfCoreEngine

SHARDED_UNITS_DIR = "units_dcp"  # a sharded out-of-core run's: one DCP checkpoint per unit
_OPTIM = "optim"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # only what trains (LoRA: the adapters), the frozen base is the model's own files
    return StateDictOptions(ignore_frozen_params=True)


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's trainable tensors (``run_state.trainable_state``: a tied weight once, as the
    single-process format) and the optimizer state keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {DCP_MODEL: trainable_state(model),
            _OPTIM: get_optimizer_state_dict(model, optimizer, options=_options())}


def save_distributed(output_dir: str | Path, step: int, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any], keep: int,
                     ranks: Ranks, engine: OutOfCoreEngine | None = None) -> Path:
    """Write one checkpoint of a data-parallel run; every rank calls it at the same step.

    Args:
        output_dir: the run's output directory (one file system seen by every rank).
        step: optimizer steps done.
        model: this rank's replica.
        optimizer: its optimizer.
        trainer_state: step, data position, RNG states (rank 0's is written).
        keep: complete checkpoints kept.
        ranks: this process's ranks.
        engine: an out-of-core engine sharded over the ranks: its weights and state are saved
            unit by unit (``offload/engine/sharded_checkpoint.py``) instead of ``model``/``optimizer``.

    Returns:
        The checkpoint directory.

    Raises:
        DiskFullError, CheckpointError: rank 0's failure, on every rank (the previous
            checkpoint intact).
        RankLostError: another rank died during the save.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if engine is None:
        state = app_state(model, optimizer)
        nbytes = tensor_bytes(state)

        def write(tmp: Path) -> None:
            dcp.save(state, checkpoint_id=tmp / DCP_DIR)
    else:
        from ...offload.engine import save_sharded

        nbytes = units_bytes(engine)

        def write(tmp: Path) -> None:
            save_sharded(engine, tmp / SHARDED_UNITS_DIR)
    out = str(output_dir)

    def announce(value: Any, what: str) -> Any:
        if isinstance(value, BaseException) and not isinstance(value, OutcoreError):
            value = CheckpointError(f"checkpoint of step {step} failed on rank 0: {type(value).__name__}: {value}")
        return broadcast_from_main(value, ranks, what, out)

    def write_dcp(tmp: Path) -> None:
        announce(tmp, "the checkpoint's start")  # 1. every rank learns where
        write(tmp)  # 2. collective

    if not ranks.is_main:
        tmp = announce(None, "the checkpoint's start")
        if isinstance(tmp, BaseException):
            raise tmp
        try:
            write(tmp)
        except (Exception, CheckpointException):  # noqa: BLE001 - the verdict comes below
            pass  # dcp reports a failure to every rank: rank 0's verdict (or a lost rank) follows
        outcome = announce(None, "the checkpoint's commit")
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    started = False

    def start_and_write(tmp: Path) -> None:
        nonlocal started
        started = True
        write_dcp(tmp)

    try:
        path = save_checkpoint(output_dir, step, {}, {}, trainer_state, keep=keep,
                                    write_extra=start_and_write, extra_bytes=nbytes)
    except (Exception, CheckpointException) as e:  # dcp's is a BaseException
        announce(e, "the checkpoint's start" if not started else "the checkpoint's commit")
        raise
    announce(path, "the checkpoint's commit")  # 3. rank 0 sealed and renamed it
    return path


def restore_trainable(ckpt_dir: str | Path, weights: dict[str, torch.Tensor], optim_state: dict[str, Any],
                      model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Put a checkpoint's trainable tensors and optimizer state into ``model`` and ``optimizer``.

    Args:
        ckpt_dir: the checkpoint (DCP or the single-process format).
        weights: its trainable tensors (``files.load_checkpoint``'s first value).
        optim_state: its ``optimizer.pt`` (``optimizer.state_dict()``; empty for DCP).
        model: the run's model (a fresh replica on every rank).
        optimizer: its optimizer, with no state yet.

    Raises:
        CheckpointError: the DCP state does not match this model or optimizer.
    """
    if is_distributed(ckpt_dir):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        # first: building the target state steps the optimizer once with zero gradients at lr 0
        state = {_OPTIM: get_optimizer_state_dict(model, optimizer, options=_options())}
        try:
            load_dcp_in_process(state, Path(ckpt_dir) / DCP_DIR)
        except Exception as e:  # noqa: BLE001 - any mismatch of keys, shapes or dtypes: named
            raise CheckpointError(f"checkpoint {str(ckpt_dir)!r} does not hold this run's optimizer state "
                                  f"({' '.join(str(e).split())[:160]}); resume with the same --optim") from None
        set_optimizer_state_dict(model, optimizer, state[_OPTIM], options=_options())
    else:
        optimizer.load_state_dict(optim_state)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in weights.items():
            named[name].copy_(t)


def restore_units(engine: OutOfCoreEngine, ckpt_dir: str | Path) -> None:
    """Load an out-of-core checkpoint's weights and state into ``engine``'s store, at any
    number of ranks: the sharded format (``units_dcp/``) or the one-process one (``units/``).

    A one-process checkpoint holds each unit's whole flat buffers, laid out as at any world
    size (``UnitLayout.states`` does not depend on the shard), so every rank reads the whole unit
    and ``overwrite`` keeps the pieces of its own range (and the kinds kept whole).
    """
    sharded = Path(ckpt_dir) / SHARDED_UNITS_DIR
    if sharded.is_dir():
        from ...offload.engine import load_sharded

        load_sharded(engine, sharded)
    else:
        load_units(engine, Path(ckpt_dir) / "units")


def sharded_unit_weights(ckpt_dir: str | Path, unit_name: str) -> dict[str, torch.Tensor]:
    """One unit's weights by parameter name from a sharded out-of-core checkpoint
    (``units_dcp/<unit>``; every rank saved the whole weights), read without a process group:
    what ``outcore export`` of such a run writes.

    Raises:
        CheckpointError: the unit's DCP state is missing or unreadable.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(ckpt_dir) / SHARDED_UNITS_DIR / unit_name
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                 if not k.startswith("state.") and isinstance(m, TensorStorageMetadata)}
        load_dcp_in_process(state, path)
    except Exception as e:  # noqa: BLE001 - digests matched, yet unreadable: name it
        raise CheckpointError(f"checkpoint {str(ckpt_dir)!r}: unit {unit_name} is unreadable ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:160]}); delete it to export the previous one") from None
    return state
