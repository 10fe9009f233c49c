"""The fault trials of ``scripts/trial_faults.py``, one generator per kind of fault.

Each ``<kind>_trials(inputs, root, modes, quick, rng)`` yields one :class:`Trial` per
fault tried; what "nothing lost" means per kind is in ``trial_faults.py``'s docstring.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from random import Random
from typing import Iterator

from _trial_run import (STEPS, Inputs, Trial, checkpoint_age, cli, error_problem, final_weights,
                        finetune_args, finish, latest_step, pause_at_step, recover, reference, same_weights, start,
                        steps_logged)

# Chosen kill points (OUTCORE_FAULT_AT), per mode. A unit's write-back happens only out of
# core; a checkpoint holds 3 files in memory and 3 + one per unit (+ units.json) out of core.
KILL_POINTS = {
    "none": ["checkpoint_file:1", "checkpoint_file:2", "checkpoint_file:3", "checkpoint_file:5",
             "checkpoint_commit:1", "checkpoint_commit:3", "eval:1", "eval:2", "eval:3",
             "export_shard:1", "export_commit:1"],
    "nvme": ["unit_write_back:1", "unit_write_back:5", "unit_write_back:17", "unit_write_back:40",
             "checkpoint_file:1", "checkpoint_file:4", "checkpoint_file:9", "checkpoint_commit:2",
             "eval:1", "eval:2", "eval:3", "export_shard:2", "export_commit:1"],
}
QUICK_KILL_POINTS = ["unit_write_back:17", "checkpoint_file:9", "export_commit:1"]
RANDOM_KILLS = 3


def kill_trials(inputs: Inputs, root: Path, modes: tuple[str, ...], quick: bool, rng: Random) -> Iterator[Trial]:
    """SIGKILL at chosen points and at random moments, then resume (see the module docstring)."""
    for mode in modes:
        ref = reference(inputs, root, mode)
        points = QUICK_KILL_POINTS if quick else KILL_POINTS[mode]
        for point in points:
            out = root / f"{mode}-{point.replace(':', '-')}"
            done = cli(finetune_args(inputs, out, mode), out.with_suffix(".log"), fault_at=point)
            if done.rc != -signal.SIGKILL:
                yield Trial(f"{mode} at {point}", False, f"not killed (rc {done.rc}): point not reached")
                continue
            problem = recover(inputs, out, mode, ref)
            yield Trial(f"{mode} at {point}", not problem, problem)
        for i in range(0 if quick else RANDOM_KILLS):
            yield _random_kill(inputs, root / f"{mode}-random-{i}", mode, ref, rng)


def _random_kill(inputs: Inputs, out: Path, mode: str, ref: dict, rng: Random) -> Trial:
    """SIGKILL a random moment after a random step was logged (0: during startup)."""
    step, delay = rng.randint(0, STEPS), rng.uniform(0.0, 0.5)
    proc = start(finetune_args(inputs, out, mode), out.with_suffix(".log"))
    while step and proc.poll() is None and steps_logged(out) < step:
        time.sleep(0.01)
    time.sleep(delay if step else rng.uniform(0.0, 5.0))
    proc.kill()
    done = finish(proc, out.with_suffix(".log"))
    name = f"{mode} random: {delay:.2f}s after step {step}" + (" (run had ended)" if done.rc == 0 else "")
    problem = recover(inputs, out, mode, ref)
    return Trial(name, not problem, problem)


# ---------------------------------------------------------------------------- corruption
def _damage(f: Path, how: str, rng: Random) -> None:
    data = bytearray(f.read_bytes())
    if how == "truncate":
        del data[len(data) // 2:]
    elif data:
        i = rng.randrange(len(data))
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _killed_after_checkpoint(inputs: Inputs, root: Path, mode: str) -> Path:
    """A run killed in its final eval: checkpoints of steps 2 and 4 on disk, 4 the newest."""
    out = root / f"{mode}-base"
    if not out.exists():
        cli(finetune_args(inputs, out, mode), out.with_suffix(".log"), fault_at="eval:3")
    return out


def _checkpoint_trials(inputs: Inputs, root: Path, mode: str, quick: bool, rng: Random) -> Iterator[Trial]:
    ref = reference(inputs, root, mode)
    base = _killed_after_checkpoint(inputs, root, mode)
    newest = base / "checkpoints" / f"step_{STEPS - 2:06d}"
    files = sorted(str(f.relative_to(newest)) for f in newest.rglob("*") if f.is_file())
    cases = [(f, how) for f in files for how in ("flip", "truncate")]
    if quick:
        cases = [c for c in cases if c[0].startswith("units/") and c[0].endswith("safetensors")][:1]
    for i, (name, how) in enumerate(cases):
        out = root / f"{mode}-ckpt-{i}"
        shutil.copytree(base, out, ignore=shutil.ignore_patterns("swap"))
        _damage(out / "checkpoints" / newest.name / name, how, rng)
        problem = recover(inputs, out, mode, ref)
        said = out.with_name(out.name + "-recover")
        told = newest.name in Path(f"{said}.out").read_text() + Path(f"{said}.err").read_text()
        if not problem and not told:
            problem = f"resumed without naming the damaged {newest.name}"
        yield Trial(f"{mode} checkpoint {name} {how}", not problem, problem)


def _swap_trial(inputs: Inputs, root: Path, rng: Random) -> Trial:
    """Flip a byte in every 4 KiB of the first MiB of the swap file while the run is stopped."""
    ref = reference(inputs, root, "nvme")
    out = root / "nvme-swap-flip"
    log = out.with_suffix(".log")
    proc = start(finetune_args(inputs, out, "nvme"), log)
    name = "nvme swap file bytes flipped during the run"
    if pause_at_step(proc, out, 2):
        swap = max((f for f in (out / "swap").glob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        with open(swap, "r+b") as f:
            for page in range(256):
                f.seek(page * 4096 + rng.randrange(4096))
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0xFF]) if b else b"\xff")
        proc.send_signal(signal.SIGCONT)
    else:
        name += " (ended before step 2)"
    done = finish(proc, log)
    if done.rc == 0:
        problem = same_weights(final_weights(out), ref)
    else:
        problem = error_problem(done, codes=None)
        if not problem and "swap" not in done.err:
            problem = f"the error does not name the swap file: {done.err.strip()}"
        problem = problem or recover(inputs, out, "nvme", ref)
    return Trial(name, not problem, problem)


def corrupt_trials(inputs: Inputs, root: Path, modes: tuple[str, ...], quick: bool, rng: Random) -> Iterator[Trial]:
    """Damaged checkpoint files (each file, flipped and truncated) and a damaged swap file."""
    for mode in modes:
        yield from _checkpoint_trials(inputs, root, mode, quick, rng)
    if "nvme" in modes:
        yield _swap_trial(inputs, root, rng)


# ------------------------------------------------------------------------------- signals
FRESH_S = 60.0  # a checkpoint this recent when the signal came need not be written again
def _signal_trial(inputs: Inputs, root: Path, mode: str, sig: int, twice: bool, extra: tuple[str, ...]) -> Trial:
    ref = reference(inputs, root, mode, *extra)
    label = f"{mode}{' ' + ' '.join(extra) if extra else ''} {signal.Signals(sig).name}{' twice' if twice else ''}"
    out = root / label.replace(" ", "-")
    log = out.with_suffix(".log")
    proc = start(finetune_args(inputs, out, mode, *extra), log)
    reached = pause_at_step(proc, out, 3)
    signalled_at = time.time()
    if reached:  # delivered the moment the run continues, mid-step
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
        if twice:
            try:
                proc.wait(0.3)
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
    done = finish(proc, log, timeout=30 if reached else 600)
    if not reached:
        return Trial(label, False, f"run ended (rc {done.rc}) before a step was logged")
    problem = error_problem(done, codes=None)
    if not problem and done.rc == 2:
        problem = "exit code 2 is bad input's, not an interruption's"
    step = latest_step(out)
    if not problem and (step is None or step < reached) and checkpoint_age(out, signalled_at) > FRESH_S:
        problem = f"no checkpoint at the step reached ({reached}; newest: {step})"
    if not problem and (out / "swap").exists():
        problem = "swap directory left behind"
    problem = problem or recover(inputs, out, mode, ref, *extra)
    return Trial(label, not problem, problem)


def signal_trials(inputs: Inputs, root: Path, modes: tuple[str, ...], quick: bool, rng: Random) -> Iterator[Trial]:
    """SIGINT and SIGTERM, once and twice, in each mode, and SIGINT during a ZO run from NVMe."""
    cases = [(m, s, t, ()) for m in modes for s in (signal.SIGINT, signal.SIGTERM) for t in (False, True)]
    if quick:
        cases = [("nvme", signal.SIGTERM, False, ())]
    elif "nvme" in modes:
        cases.append(("nvme", signal.SIGINT, False, ("--method", "zo", "--optim", "mezo")))
    for mode, sig, twice, extra in cases:
        yield _signal_trial(inputs, root, mode, sig, twice, extra)


# ------------------------------------------------------------------------------ two runs
def _two_runs_trial(inputs: Inputs, root: Path, mode: str, shared: str) -> Trial:
    ref = reference(inputs, root, mode)
    label = f"{mode} second run on the {shared}"
    first = root / label.replace(" ", "-")
    swap = ("--swap-dir", str(root / f"{mode}-shared-swap")) if shared == "swap dir" else ()
    log = first.with_suffix(".log")
    proc = start(finetune_args(inputs, first, mode, *swap), log)
    if not pause_at_step(proc, first, 1):
        return Trial(label, False, f"first run ended (rc {finish(proc, log).rc}) before a step was logged")
    second_out = first.with_name(first.name + "-second") if swap else first
    extra = ("--overwrite",) if shared.endswith("--overwrite") else ()
    second = cli(finetune_args(inputs, second_out, mode, *swap, *extra), second_out.with_suffix(".log2"))
    proc.send_signal(signal.SIGCONT)
    done = finish(proc, log)
    problem = error_problem(second)
    problem = f"second run: {problem}" if problem else ""
    if not problem and done.rc != 0:
        problem = f"first run exited {done.rc}: {done.err.strip()[-300:]}"
    problem = problem or same_weights(final_weights(first), ref)
    if not problem and (steps_logged(first) != STEPS or not (first / "config.yaml").is_file()):
        problem = (f"the first run's metrics.jsonl or config.yaml was removed under it "
                   f"(steps logged: {steps_logged(first)})")
    return Trial(label, not problem, problem)


def two_runs_trials(inputs: Inputs, root: Path, modes: tuple[str, ...], quick: bool, rng: Random) -> Iterator[Trial]:
    """A second run on a live run's output directory (with and without --overwrite) or swap dir."""
    root.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        shared = ["output dir", "output dir --overwrite"] + (["swap dir"] if mode == "nvme" else [])
        for what in (shared[:1] + shared[2:] if quick else shared):
            yield _two_runs_trial(inputs, root, mode, what)
