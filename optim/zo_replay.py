"""Exact replay of a ZO run from its (seed, scalar) log.

A ZO run's trajectory is fixed by its base weights and, per step, the sample
seeds, projected gradients and learning rate. The run log (``zo_log.jsonl``:
one header line, then one JSON line per step — about 100 bytes a step, so
kilobytes per thousand steps) plus the base weights *is* the checkpoint;
:func:`replay` turns it back into the trained weights, bit-for-bit, by calling
the same update code (:mod:`outcore.optim.zo_core`) in the same order:

* schedule ``"exact"`` (block schedule, :mod:`outcore.offload.zo.engine`):
  perturbations never touch the clean weights, so replay applies only the updates;
* schedule ``"inplace"`` (:class:`outcore.optim.mezo.MeZO`): replay also
  re-applies the ``+eps, -2 eps, +eps`` perturbations, whose fp32 rounding is
  part of the trajectory.

The header records where z was drawn (``torch-cpu``, ``torch-cuda`` or ``triton``;
``kernels/zo_perturb.py``): replay draws it the same way, on any device that can
(``torch-cpu`` anywhere; a GPU run's noise needs a GPU).
Exporting a run directory (replay onto the base model it names) is the ZO
recipe's job: :func:`outcore.recipes.export.export_zo_run`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import xxhash

from ..errors import CheckpointError
from .zo_core import StepRecord, ZOHyper, ZOState, apply_update_, mask_for, perturb_

LOG_NAME = "zo_log.jsonl"
FORMAT = "outcore-zo-log/1"


@dataclass
class ZOLog:
    """The header (schedule, hyper-parameters, parameter names) and step records of a run."""

    header: dict[str, Any]
    records: list[StepRecord] = field(default_factory=list)
    damaged: str | None = None  # set by load: what a damaged or torn tail cost (None: nothing)

    def save(self, path: str | Path) -> Path:
        """Write the whole log to ``path`` (a file, or a directory to hold ``zo_log.jsonl``)."""
        p = Path(path)
        if p.is_dir():
            p = p / LOG_NAME
        lines = [_line({"format": FORMAT, "header": self.header})]
        lines += [_line(r.to_json()) for r in self.records]
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(lines))
        tmp.replace(p)  # atomic: a crash never leaves half a log
        return p

    @classmethod
    def load(cls, path: str | Path) -> "ZOLog":
        """Read a log written by :meth:`save` or :class:`ZOLogWriter`.

        Every line carries the xxh32 of its content (``"xxh"``; a log from before has none).
        A step line that is torn (a kill mid-write) or damaged ends the log there: the steps
        before it are the newest valid checkpoint, and :attr:`damaged` says what was dropped.

        Raises:
            CheckpointError: a missing file, a foreign format, or a damaged header.
        """
        p = Path(path)
        if p.is_dir():
            p = p / LOG_NAME
        if not p.is_file():
            raise CheckpointError(f"ZO log {str(p)!r} does not exist; pass a ZO run directory or its {LOG_NAME}")
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
        try:
            first = _parse(lines[0])
            if first.get("format") != FORMAT:
                raise ValueError(f"format {first.get('format')!r}")
        except (ValueError, KeyError, IndexError) as e:
            raise CheckpointError(f"ZO log {str(p)!r} is malformed ({e}); it must start with a "
                                  f"{FORMAT!r} header line") from None
        records, damaged = [], None
        for n, ln in enumerate(lines[1:], start=2):
            try:
                records.append(StepRecord.from_json(_parse(ln)))
            except (ValueError, KeyError, TypeError) as e:
                damaged = f"ZO log {str(p)!r} line {n} is damaged ({e}): its {len(lines) - n + 1} last line(s) dropped"
                break
        for i, r in enumerate(records):
            if r.step != i + 1:
                raise CheckpointError(f"ZO log {str(p)!r}: record {i} has step {r.step}, expected {i + 1}")
        return cls(first["header"], records, damaged)


class ZOLogWriter:
    """Appends records to ``zo_log.jsonl`` as a run goes (one flushed line per step)."""

    def __init__(self, run_dir: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(run_dir) / LOG_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")
        self._f.write(_line({"format": FORMAT, "header": header}))
        self._f.flush()

    def append(self, rec: StepRecord) -> None:
        self._f.write(_line(rec.to_json()))
        self._f.flush()  # a crashed run keeps every finished step

    def close(self) -> None:
        self._f.close()


def _line(obj: dict[str, Any]) -> str:
    """One log line: ``obj`` as JSON with the xxh32 of that JSON added as ``"xxh"``."""
    text = json.dumps(obj)
    return json.dumps({**obj, "xxh": xxhash.xxh32_intdigest(text.encode())}) + "\n"


def _parse(line: str) -> dict[str, Any]:
    """The object of a :func:`_line` (checked against its ``"xxh"``; a line without one, from
    an older log, is taken as it is).

    Raises:
        ValueError: not JSON, or its checksum does not match (a flipped byte, a torn line).
    """
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    if "xxh" in obj:
        want = obj.pop("xxh")
        if xxhash.xxh32_intdigest(json.dumps(obj).encode()) != want:
            raise ValueError("checksum mismatch")
    return obj


def _clone_state(base: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = base.state_dict() if isinstance(base, torch.nn.Module) else dict(base)
    clones: dict[int, torch.Tensor] = {}
    out = {}
    for k, t in sd.items():  # tied tensors (same storage) stay tied in the copy
        key = t.data_ptr()
        if key not in clones:
            clones[key] = t.detach().clone().contiguous()
        out[k] = clones[key]
    return out


def replay(base: torch.nn.Module | Mapping[str, torch.Tensor], log: ZOLog | str | Path,
           steps: int | None = None) -> dict[str, torch.Tensor]:
    """Rebuild the trained weights from the base weights and a ZO run log.

    Args:
        base: the model or state dict the run started from (not modified).
        log: a :class:`ZOLog` or the path of a run directory / ``zo_log.jsonl``.
        steps: replay only the first ``steps`` records (None = all).

    Returns:
        A new state dict (every key of ``base``) holding the trained weights.

    Raises:
        CheckpointError: a parameter named in the log is missing from ``base`` or
            has another shape.
    """
    if not isinstance(log, ZOLog):
        log = ZOLog.load(log)
    sd = _clone_state(base)
    replay_into_(sd, log, steps)
    return sd


@torch.no_grad()
def replay_into_(tensors: Mapping[str, torch.Tensor], log: ZOLog, steps: int | None = None) -> None:
    """Apply a run log to ``tensors`` (name -> tensor) in place; see :func:`replay`."""
    header = log.header
    hyper = ZOHyper(**header["hyper"])
    params = []
    for spec in header["params"]:
        name = spec["name"]
        if name not in tensors:
            raise CheckpointError(f"ZO log parameter {name!r} is not in the base weights; "
                                  "replay onto the model the run started from")
        t = tensors[name]
        if list(t.shape) != list(spec["shape"]):
            raise CheckpointError(f"ZO log parameter {name!r} has shape {spec['shape']}, base has "
                                  f"{list(t.shape)}; replay onto the model the run started from")
        params.append(t)
    inplace = header["schedule"] == "inplace"
    state = ZOState(hyper, backend=header.get("backend"))
    for rec in log.records[:steps]:
        if rec.thresholds is not None:
            state.thresholds = list(rec.thresholds)
        if inplace:
            for s in rec.seeds:
                masks = [mask_for(p, state, j) for j, p in enumerate(params)]
                for scale in (hyper.eps, -2.0 * hyper.eps, hyper.eps):
                    for j, p in enumerate(params):
                        perturb_(p, s, j, scale, masks[j], backend=state.backend)
        state.push(rec)
        for j, p in enumerate(params):
            apply_update_(p, j, state)
