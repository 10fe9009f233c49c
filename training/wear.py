"""SSD wear: the bytes a run writes to its swap disk, and the share of the drive's rated life.

An SSD is rated for a number of terabytes written (TBW, decimal terabytes, as drive makers
state it). Out of core, every step writes the updated weights and optimizer state back to
the swap file, so a long run on a small drive can use a visible share of that rating.
:class:`WearMeter` counts what a run writes to its swap disk:

- the swap file, from the store's own traffic counters (``offload/store/traffic.py``: bytes written
  into the NVME tier): the initial placement of the weights and optimizer state, every
  write-back of updated weights, state and spilled gradients, and activations offloaded to
  NVMe through the run's store (a ZO run streaming from NVMe counts the same way);
- the checkpoints (``OUTPUT/checkpoints/step_*``) and the export (``OUTPUT/final``) when the
  output directory is on the swap directory's file system (the same disk), counted as the
  bytes of their files once each is complete.

It does not count the small files a run rewrites (``metrics.jsonl``, the ZO log, the
config) nor writes of other processes. It fills the ``ssd_*`` fields of the ``StepEvent``
and ``RunFinished`` events; the UIs only render them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..events import RunFinished, StepEvent
from ..offload.store import Tier
from .checkpoint.files import checkpoints

TB = 10**12  # TBW ratings are in decimal terabytes
PER_STEPS = 1000  # the projection: the share of the rating this many steps would use


#: The rating the summary states a run's share of when the drive's is not given (``--ssd-tbw``):
#: a 1 TB consumer NVMe drive's, as common TLC drives of that size are rated (600 TBW).
TYPICAL_TBW = 600.0


def life_used_pct(written_bytes: float, tbw: float) -> float:
    """Percent of a drive's rated endurance that ``written_bytes`` use.

    Args:
        written_bytes: bytes written to the drive.
        tbw: the drive's rated terabytes written (> 0).

    Returns:
        ``100 * written_bytes / (tbw * 10**12)``.

    Raises:
        ConfigError: ``tbw`` is not a finite number > 0.
    """
    if not (isinstance(tbw, (int, float)) and 0 < tbw < float("inf")):
        raise ConfigError(f"ssd_tbw={tbw!r} must be the drive's rated terabytes written, a number > 0 "
                          "(e.g. --ssd-tbw 600)")
    return 100.0 * written_bytes / (tbw * TB)


def _device_of(path: Path) -> int | None:
    """The file system (``st_dev``) holding ``path``, or its nearest existing ancestor."""
    for p in (path, *path.parents):
        try:
            return os.stat(p).st_dev
        except OSError:
            continue
    return None


def _dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a checkpoint or export just written)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                pass  # removed meanwhile (an old checkpoint rotated out)
    return total


class WearMeter:
    """Counts a run's writes to its swap disk and fills the events' ``ssd_*`` fields.

    Built when the first step is about to start: what was written before (the store's
    initial placement) counts in the run's total but not in the per-step figures.

    Args:
        store: the run's ``TieredStore`` (None: nothing streams, no swap file).
        tbw: the drive's rated terabytes written (``ssd_tbw``; 0: unknown, no life shares).
        swap_dir: the run's swap directory (it need not exist yet).
        output_dir: the run's output directory (checkpoints, final/).
        step: the step the run starts from (a resumed run's checkpoint step).
    """

    def __init__(self, store: Any, tbw: float, swap_dir: Path, output_dir: Path, step: int) -> None:
        self._traffic = None if store is None else store.traffic
        self.tbw = float(tbw or 0.0)
        if self.tbw:
            life_used_pct(0, self.tbw)  # a bad rating (from Python, past the config) fails now
        self._out = Path(output_dir)
        self._files_on_disk = _device_of(Path(swap_dir)) == _device_of(self._out)
        # directories already there (a resumed run's checkpoints) are not this run's writes
        self._counted: dict[tuple[str, int], int] = {key: 0 for key in self._complete_dirs()}
        self._start = self._prev = (step, self.written())
        self._per_1000: float | None = None

    def _complete_dirs(self) -> dict[tuple[str, int], Path]:
        """Complete checkpoints and the export, keyed (name, inode): a rewritten one is new."""
        if not self._files_on_disk:
            return {}
        dirs = checkpoints(self._out)
        final = self._out / "final"
        if (final / "config.json").is_file():
            dirs.append(final)
        out = {}
        for d in dirs:
            try:
                out[(d.name, d.stat().st_ino)] = d
            except OSError:
                pass
        return out

    def written(self, swap: int | None = None) -> int:
        """Bytes this run has written to the swap disk so far (see the module doc for what counts).

        Args:
            swap: the store's NVMe written bytes as an event already read them (so that a row's
                figures agree: write-backs keep landing); None reads the counters now.
        """
        for key, path in self._complete_dirs().items():
            if key not in self._counted:
                self._counted[key] = _dir_bytes(path)
        if swap is None:
            swap = 0 if self._traffic is None else self._traffic.totals(Tier.NVME)[1]
        return swap + sum(self._counted.values())

    def fill(self, event: StepEvent | RunFinished) -> StepEvent | RunFinished:
        """Set ``event``'s ``ssd_*`` fields from the counters now.

        A StepEvent's swap bytes are those its ``tiers`` read (the counters when it has none);
        it gets the bytes per step since the previous one filled (its interval's
        checkpoints included), and with a rating, the projection of 1000 steps at this run's
        mean since its first step; RunFinished keeps the last StepEvent's projection (its
        total also holds the final checkpoint and export, written once).

        Args:
            event: the event about to be emitted.

        Returns:
            The same event.
        """
        nvme = event.tiers.get(Tier.NVME.name) if isinstance(event, StepEvent) else None
        written = self.written(None if nvme is None else nvme.written_bytes)
        event.ssd_written_bytes = written
        if isinstance(event, StepEvent):
            step, (prev_step, prev_written) = event.step, self._prev
            if step > prev_step:
                event.ssd_written_per_step_bytes = (written - prev_written) / (step - prev_step)
            self._prev = (step, written)
            first_step, first_written = self._start
            if self.tbw and step > first_step:
                mean = (written - first_written) / (step - first_step)
                self._per_1000 = life_used_pct(PER_STEPS * mean, self.tbw)
        if self.tbw:
            event.ssd_life_used_pct = life_used_pct(written, self.tbw)
            event.ssd_life_per_1000_steps_pct = self._per_1000
        return event
