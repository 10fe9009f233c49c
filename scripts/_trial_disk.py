"""Full-disk fault trials of ``scripts/trial_faults.py``: swap and output directories on
small real file systems (sparse ext4 images, loop-mounted), full before the run or filled
during it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from random import Random
from typing import Iterator

from _trial_run import (Inputs, Trial, cli, debris, error_problem, final_weights, finetune_args, finish,
                        pause_at_step, recover, reference, same_weights, start)

_MOUNTS: list[Path] = []
_MOUNT_OK: list[str] = []  # '' once a loop mount worked, else why not (cached)


def unavailable(kind: str) -> str:
    """Why ``kind`` cannot be tried on this machine ('' when it can): only ``disk`` needs
    something (root, mkfs.ext4 and a loop mount that works), found out once."""
    if kind != "disk":
        return ""
    if _MOUNT_OK:
        return _MOUNT_OK[0]
    why = ""
    if os.geteuid() != 0:
        why = "not root: no loop mount"
    elif not shutil.which("mkfs.ext4") or not shutil.which("mount"):
        why = "mkfs.ext4 or mount missing"
    else:
        with tempfile.TemporaryDirectory(prefix="outcore-fs-probe-") as probe:
            try:
                small_fs(Path(probe) / "fs", 8)
            except (OSError, subprocess.CalledProcessError) as e:
                why = f"loop mount refused here ({e})"
            finally:
                unmount_all()
    _MOUNT_OK.append(why)
    return why


def small_fs(where: Path, mib: int) -> Path:
    """A fresh ext4 file system of ``mib`` MiB (a sparse image, loop-mounted) at ``where``.

    Raises:
        subprocess.CalledProcessError: mkfs or mount failed.
    """
    where.mkdir(parents=True, exist_ok=True)
    image = where.with_suffix(".img")
    with open(image, "wb") as f:
        f.truncate(mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
    _MOUNTS.append(where)  # unmounted (and its image removed) by unmount_all, mounted or not
    subprocess.run(["mount", "-o", "loop", str(image), str(where)], check=True, capture_output=True)
    return where


def unmount_all() -> None:
    """Unmount every file system :func:`small_fs` mounted and delete its image."""
    while _MOUNTS:
        where = _MOUNTS.pop()
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
        where.with_suffix(".img").unlink(missing_ok=True)


def fill(fs: Path, leave: int) -> Path:
    """Take all but ``leave`` bytes of the free space of ``fs`` with one file (returned)."""
    filler = fs / "filler"
    free = shutil.disk_usage(fs).free + (filler.stat().st_size if filler.exists() else 0)
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - leave, 1))
    return filler


def _full_before(inputs: Inputs, root: Path, mode: str, on: str) -> Trial:
    fs = small_fs(root / f"{mode}-{on}-before-fs", 32)
    fill(fs, 64 << 10)
    out, extra = ((fs / "run", ()) if on == "output"
                  else (root / f"{mode}-{on}-before", ("--swap-dir", str(fs / "swap"))))
    done = cli(finetune_args(inputs, out, mode, *extra), root / f"{mode}-{on}-before.log")
    problem = error_problem(done, codes=None) or (f"left {debris(out)}" if debris(out) else "")
    return Trial(f"{mode} {on} dir full before the run", not problem, problem)


def _full_during(inputs: Inputs, root: Path, mode: str, on: str, ref: dict) -> Trial:
    fs = small_fs(root / f"{mode}-{on}-during-fs", 64 if on == "output" else 1200)
    out, extra = ((fs / "run", ()) if on == "output"
                  else (root / f"{mode}-{on}-during", ("--swap-dir", str(fs / "swap"))))
    log = root / f"{mode}-{on}-during.log"
    proc = start(finetune_args(inputs, out, mode, *extra), log)
    name = f"{mode} {on} dir filled during the run"
    if pause_at_step(proc, out, 3):
        filler = fill(fs, 4 << 10)
        proc.send_signal(signal.SIGCONT)
    else:
        filler = None
        name += " (ended before step 3)"
    done = finish(proc, log)
    if filler is not None:
        filler.unlink()
    if done.rc == 0:
        problem = same_weights(final_weights(out), ref)
    else:
        problem = error_problem(done, codes=None) or (f"left {debris(out)}" if debris(out) else "")
        problem = problem or recover(inputs, out, mode, ref, *extra)
    return Trial(name, not problem, problem)


def disk_trials(inputs: Inputs, root: Path, modes: tuple[str, ...], quick: bool, rng: Random) -> Iterator[Trial]:
    """Swap and output directories on small file systems, full before or filled during the run."""
    root.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        ref = reference(inputs, root, mode)
        places = ("output",) + (("swap",) if mode == "nvme" else ())
        for on in places:
            yield _full_before(inputs, root, mode, on)
            if not quick:
                yield _full_during(inputs, root, mode, on, ref)
