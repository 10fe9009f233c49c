"""A run's checkpoints on disk: their layout, the atomic write, the digests that verify them,
and loading. What they hold of the run (RNG states, trainable tensors, the units of a run out
of core) is ``run_state.py``'s; a data-parallel run's DCP state is ``dcp.py``'s.

Layout of ``OUTPUT/checkpoints``::

    step_000040/            one complete checkpoint (never modified once renamed)
        model.safetensors   trainable state (all weights for full fine-tuning in memory;
                            the adapters for LoRA; empty for a full fine-tune out of core)
        optimizer.pt        optimizer.state_dict() (empty out of core)
        dcp/                under torchrun: model and optimizer state as one
                            torch.distributed.checkpoint (``dcp.py``)
        trainer.pt          step, RNG states, data position, run facts
        units/              out of core only: one ``<unit>.safetensors`` per unit (its
                            weights ``w`` and each optimizer-state kind) and ``units.json``
                            (``run_state.save_units``)
        COMPLETE            written last: xxh64 of every file (and of itself); a directory
                            without it is never loaded, and a file whose digest differs is
                            named and never loaded
    latest                  text file naming the newest complete checkpoint

A checkpoint is written into ``step_X.tmp``, each file fsynced, then renamed
and ``latest`` replaced atomically, so a kill at any moment (Ctrl-C included)
leaves the previous checkpoint intact and loadable. Before writing, the free
space is checked against the checkpoint's bytes (known in advance); a disk that
fills anyway stops with :class:`~outcore.errors.DiskFullError` and no ``.tmp``
left, and ``.tmp`` debris of a killed run is removed by the next save. Only the
newest ``keep`` checkpoints stay; an old one is removed after the new one is
complete, renamed to ``.tmp`` first so a half-removed directory is never taken
for a checkpoint. Directories are 0700 and files 0600 (they hold the user's
weights). Loading uses no pickle beyond tensors, plain containers and NumPy's RNG
state (``torch.load(weights_only=True)``), so a checkpoint from elsewhere cannot run code.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import stat
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import xxhash
from safetensors.torch import load_file, save_file

from ..._faults import fault_point
from ...bytesize import format_bytes
from ...errors import CheckpointError, DiskFullError

_DIR = "checkpoints"
_LATEST = "latest"
_COMPLETE = "COMPLETE"
_TMP = ".tmp"
DCP_DIR = "dcp"  # inside a checkpoint directory: the DCP files (``.metadata``, ``__R_0.distcp``)
DCP_MODEL = "model"  # the DCP state's key of the trainable tensors (``dcp.py``)
# Bytes a checkpoint needs beyond its tensors: safetensors headers and the small files.
_SLACK_BYTES = 4 << 20
# What the restricted unpickler may build besides tensors and containers: NumPy's RNG
# state (an array of uint32) in trainer.pt.
_NUMPY_CORE = np._core if hasattr(np, "_core") else np.core  # NumPy 2 renamed it
_NUMPY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _NUMPY_CORE.multiarray._reconstruct]


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


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (a test replaces it to fake a full disk)."""
    return shutil.disk_usage(path).free


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nest of dicts, lists and tuples (what a checkpoint writes)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def is_disk_full(exc: BaseException) -> bool:
    """True for ENOSPC, also when a library wraps it (safetensors reports ``code: 28``)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


def _disk_full(root: Path, need: int) -> DiskFullError:
    return DiskFullError(f"checkpoint directory {root} needs {format_bytes(need)} but its disk has "
                         f"{format_bytes(free_bytes(root))} free; free space and "
                         "continue with --resume: the previous checkpoint is intact")


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, stat.S_IRWXU)


def _remove_debris(root: Path) -> None:
    """Remove ``.tmp`` leftovers: a checkpoint or ``latest`` a killed run was writing, or an
    old checkpoint it was removing. None of them is ever read."""
    for p in root.glob("*" + _TMP):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _seal(tmp: Path, step: int) -> list[Path]:
    """Make the files private, digest them into ``COMPLETE`` (digested itself) and fsync all."""
    files = sorted(f for f in tmp.rglob("*") if f.is_file())
    for d in {f.parent for f in files} | {tmp}:
        os.chmod(d, stat.S_IRWXU)
    for f in files:
        os.chmod(f, stat.S_IRUSR | stat.S_IWUSR)
    body = {"step": step, "xxh64": {str(f.relative_to(tmp)): _digest(f) for f in files}}
    body["self"] = xxhash.xxh64(json.dumps(body, sort_keys=True).encode()).hexdigest()
    marker = tmp / _COMPLETE
    marker.write_text(json.dumps(body, sort_keys=True))
    os.chmod(marker, stat.S_IRUSR | stat.S_IWUSR)
    for f in [*files, marker]:
        _fsync(f)
    return files


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the sealed ``tmp`` to ``final`` and point ``latest`` at it, each step atomic."""
    if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
        _discard(final)
    os.replace(tmp, final)
    fault_point("checkpoint_commit")
    latest_tmp = root / (_LATEST + _TMP)
    latest_tmp.write_text(final.name)
    os.chmod(latest_tmp, stat.S_IRUSR | stat.S_IWUSR)
    _fsync(latest_tmp)
    os.replace(latest_tmp, root / _LATEST)
    _fsync(root)


def _discard(ckpt: Path) -> None:
    """Remove a checkpoint: renamed to ``.tmp`` first (atomic), so a kill mid-removal leaves
    debris the next save clears, never a half checkpoint that still looks complete."""
    doomed = ckpt.with_name(ckpt.name + ".old" + _TMP)
    os.replace(ckpt, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _complete(root: Path) -> list[Path]:
    """Checkpoint directories with a ``COMPLETE`` marker, oldest first."""
    return sorted(d for d in root.glob("step_*") if not d.name.endswith(_TMP) and (d / _COMPLETE).is_file())


def save_checkpoint(output_dir: str | Path, step: int, model_state: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any], trainer_state: dict[str, Any],
                    keep: int = 2, write_extra: Callable[[Path], None] | None = None,
                    extra_bytes: int = 0) -> Path:
    """Write one checkpoint atomically and prune old ones.

    Args:
        output_dir: the run's output directory.
        step: the number of optimizer steps done.
        model_state: name -> tensor (see ``run_state.trainable_state``).
        optimizer_state: ``optimizer.state_dict()`` (tensors and plain containers).
        trainer_state: everything else needed to resume (tensors, plain containers, NumPy RNG state).
        keep: how many complete checkpoints to keep (>= 1); older ones are removed once
            this one is complete.
        write_extra: writes more files into the (temporary) checkpoint directory,
            e.g. the unit files of an out-of-core run; they are checksummed too.
        extra_bytes: what ``write_extra`` writes, for the free-space check.

    Returns:
        The checkpoint directory.

    Raises:
        DiskFullError: the disk has not room for the checkpoint (checked before writing,
            or ENOSPC while writing); nothing of it is left, the previous one is intact.
    """
    root = Path(output_dir) / _DIR
    _private_dir(root)
    _remove_debris(root)
    need = (tensor_bytes(model_state) + tensor_bytes(optimizer_state) + tensor_bytes(trainer_state)
            + extra_bytes + _SLACK_BYTES)
    if free_bytes(root) < need:
        raise _disk_full(root, need)
    final = root / f"step_{step:06d}"
    tmp = root / (final.name + _TMP)
    try:
        _private_dir(tmp)
        save_file(model_state, str(tmp / "model.safetensors"))
        fault_point("checkpoint_file")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        fault_point("checkpoint_file")
        torch.save(trainer_state, tmp / "trainer.pt")
        fault_point("checkpoint_file")
        if write_extra is not None:
            write_extra(tmp)
        _seal(tmp, step)
    except BaseException as e:
        # torch.save reports ENOSPC as "unexpected pos": an empty disk at the failure says it
        full = is_disk_full(e) or (isinstance(e, Exception) and free_bytes(root) < _SLACK_BYTES)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise _disk_full(root, need) from None
        raise
    _publish(root, tmp, final)
    for old in _complete(root)[:-max(1, keep)]:
        _discard(old)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None when it has none."""
    found = checkpoints(output_dir)
    return found[0] if found else None


def checkpoints(output_dir: str | Path) -> list[Path]:
    """A run's complete checkpoints, newest first (the one ``latest`` names leads)."""
    root = Path(output_dir) / _DIR
    found = _complete(root)[::-1]
    pointer = root / _LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def verify_checkpoint(ckpt_dir: str | Path) -> None:
    """Check every file of a checkpoint against its ``COMPLETE`` digests, reading nothing else.

    Raises:
        CheckpointError: no marker, a damaged marker, or a file missing, truncated or
            changed (named).
    """
    d = Path(ckpt_dir)
    if not (d / _COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {str(d)!r} is incomplete (no {_COMPLETE} marker); "
                              "resume from an earlier one or start over with --overwrite")
    try:
        body = json.loads((d / _COMPLETE).read_text())
        expected = body["xxh64"]
        sealed = body.pop("self", None)
        if sealed is not None and sealed != xxhash.xxh64(json.dumps(body, sort_keys=True).encode()).hexdigest():
            raise ValueError("its own digest differs")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {str(d)!r} has a damaged {_COMPLETE} marker; "
                              "delete the directory to resume from the previous checkpoint") from None
    for name, digest in expected.items():
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {str(f)!r} is missing; "
                                  "delete its directory to resume from the previous checkpoint")
        if _digest(f) != digest:
            what = f" (unit {f.stem})" if f.parent.name == "units" and f.suffix == ".safetensors" else ""
            raise CheckpointError(f"checkpoint file {str(f)!r}{what} is corrupt or truncated (checksum "
                                  "mismatch); delete its directory to resume from the previous checkpoint")


def load_checkpoint(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint`, verified first.

    Returns:
        (model_state, optimizer_state, trainer_state).

    Raises:
        CheckpointError: a missing, incomplete, corrupt or unreadable checkpoint, or one
            whose state would need pickle to load (never executed).
    """
    d = Path(ckpt_dir)
    verify_checkpoint(d)
    try:
        model_state = load_file(str(d / "model.safetensors"))
        # on the CPU: a run's optimizer state is saved where it computed (a GPU), and its export
        # or resume may run elsewhere; load_state_dict moves the state back beside its parameters
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            optimizer_state = torch.load(d / "optimizer.pt", weights_only=True, map_location="cpu")
            trainer_state = torch.load(d / "trainer.pt", weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:  # weights_only refused an object: never run it
        raise CheckpointError(f"checkpoint {str(d)!r} holds objects outcore does not load (they could run "
                              f"code: {' '.join(str(e).split())[:160]}); start over with --overwrite") from None
    except Exception as e:  # noqa: BLE001 - unreadable despite its digest: name it, never continue silently
        raise CheckpointError(f"checkpoint {str(d)!r} is unreadable ({type(e).__name__}: {e}); "
                              "delete it to resume from the previous one") from None
    if is_distributed(d):  # written under torchrun: the trainable tensors are DCP's
        model_state = dcp_model_state(d)
    return model_state, optimizer_state, trainer_state


def load_newest_valid(output_dir: str | Path) -> tuple[Path, tuple, list[str]]:
    """The newest checkpoint of a run that verifies and loads, skipping damaged ones.

    Returns:
        ``(directory, load_checkpoint(directory), skipped)``: ``skipped`` says, one line
        each, which newer checkpoints were passed over and why.

    Raises:
        CheckpointError: the run has no checkpoint that loads (the newest one's error).
    """
    skipped: list[str] = []
    for d in checkpoints(output_dir):
        try:
            return d, load_checkpoint(d), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    if skipped:
        raise CheckpointError(f"no checkpoint of {str(output_dir)!r} loads: {skipped[0]}")
    raise CheckpointError(f"--resume {str(output_dir)!r}: the run has no complete checkpoint; "
                          "start over with --overwrite")


def is_distributed(ckpt_dir: str | Path) -> bool:
    """Whether a checkpoint directory holds DCP state (written under torchrun)."""
    return (Path(ckpt_dir) / DCP_DIR).is_dir()


def dcp_model_state(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The trainable tensors of a DCP checkpoint by parameter name, read without a model
    (:func:`load_checkpoint` returns them, so export and resume read one format)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(ckpt_dir) / DCP_DIR
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        prefix = DCP_MODEL + "."
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                 if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
        load_dcp_in_process(state, path)
    except Exception as e:  # noqa: BLE001 - digests matched, yet unreadable: name it
        raise CheckpointError(f"checkpoint {str(ckpt_dir)!r} has unreadable DCP state ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:160]}); delete it to resume from the previous one") from None
    return {k[len(prefix):]: v for k, v in state.items()}


def load_dcp_in_process(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` in this process alone: every rank reads the replicated state itself."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # it warns that it loads in one process: what is asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)

