"""Fault trials: the real ``outcore finetune`` command, crashed, starved, corrupted, signalled.

Every trial runs ``python -m outcore finetune`` in a subprocess on a tiny Llama (built
here and saved as a Hugging Face directory, byte-level BPE tokenizer of 320 tokens, a
few kB of Hamlet), in memory (``--offload none``) and out of core (``--offload nvme``),
and compares what it leaves with an uninterrupted run of the same config. Per kind of
fault it reports trials tried and trials with nothing lost; a failure says why.

"Nothing lost", per kind:

kill
    SIGKILL at a chosen point (``OUTCORE_FAULT_AT``, see ``outcore/_faults.py``: a unit's
    write-back, between the files of a checkpoint, the checkpoint's commit, eval, export)
    or at a random moment (0-0.5 s after a random step was logged, or during startup).
    The killed run died of SIGKILL (a point that was never reached is a failed trial);
    recovery is ``--resume`` when a complete
    checkpoint exists, else a fresh run with ``--overwrite``; it exits 0 and the final
    weights (``final/*.safetensors``) are bit-identical to the uninterrupted run's.
disk
    The swap or output directory on a small real file system (a loop-mounted ext4 image:
    needs root and ``mount``; where it cannot be had the kind reports 0 tried and why).
    Full before the run: refused (before training, or at the first checkpoint) with one
    line ``outcore: error: ...`` on stderr, no traceback, an exit code other than 0, 1
    and a signal's, and no ``*.tmp`` left in ``checkpoints/``. Filled during the
    run: either the run finishes with the reference weights, or it stops with one line,
    no traceback, an exit code other than 0, 1 and a signal's, no ``*.tmp`` left in
    ``checkpoints/``, and ``--resume`` (space freed) gives the reference weights.
corrupt
    A byte flipped in, or the tail cut off, each file of the newest checkpoint of a run
    killed after it: ``--resume`` exits 0, names the damaged checkpoint, falls back to the
    newest complete and valid one and ends with the reference weights. Bytes flipped in
    the swap file during a run: either the run finishes with the reference weights (the
    damaged extents were rewritten before being read), or it stops with one line naming
    the swap file, no traceback, and ``--resume`` gives the reference weights.
signal
    SIGINT or SIGTERM once training has logged a step (and the same followed by a second
    signal 0.3 s later): exit code other than 0, 1 and 2 and not death by the signal
    itself, within 30 s of the last signal; at most one line on stderr and no traceback;
    a complete checkpoint at the step reached (or one completed at most 60 s before the
    signal; a ZO run's checkpoint is its log of steps); the swap directory removed; ``--resume`` gives the
    reference weights.
two_runs
    A second run on the output directory (with and without ``--overwrite``) or on the
    swap directory of a live run (stopped with SIGSTOP while the second starts): the
    second exits 2 with one line, the first, continued, exits 0 with the reference weights,
    its config.yaml and every row of its metrics.jsonl.

Usage::

    python scripts/trial_faults.py --json            # every kind, both modes (~30 min on 2 cores)
    python scripts/trial_faults.py --quick --json    # the CI subset
    python scripts/trial_faults.py --soak 1000 --json
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from outcore.cli.jsonout import emit_json, json_stdout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _trial_disk import disk_trials, unavailable, unmount_all
from _trial_kinds import corrupt_trials, kill_trials, signal_trials, two_runs_trials
from _trial_run import build_inputs
from _trial_soak import soak

TRIALS = {"kill": kill_trials, "disk": disk_trials, "corrupt": corrupt_trials, "signal": signal_trials,
          "two_runs": two_runs_trials}
KINDS = tuple(TRIALS)


@dataclass
class KindReport:
    """Trials of one kind of fault: how many were tried, how many lost nothing, and why not."""

    tried: int = 0
    nothing_lost: int = 0
    failures: list[str] = field(default_factory=list)
    not_tried: str | None = None  # why none could be tried here (e.g. no loop mount)


def run_trials(root: Path, quick: bool, seed: int, only: tuple[str, ...] = KINDS, log=print
               ) -> dict[str, KindReport]:
    """Run every trial of the kinds in ``only`` and tally them per kind.

    Args:
        root: a scratch directory (inputs, runs and file systems go there).
        quick: the CI subset (out of core only, a few trials per kind).
        seed: seeds the random kill moments and corrupted offsets.
        only: which kinds to run.
        log: called with one line per trial.

    Returns:
        kind -> KindReport.
    """
    rng = random.Random(seed)
    inputs = build_inputs(root / "inputs")
    modes = ("nvme",) if quick else ("none", "nvme")
    reports: dict[str, KindReport] = {}
    for kind in only:
        rep = reports[kind] = KindReport()
        reason = unavailable(kind)
        if reason:
            rep.not_tried = reason
            log(f"{kind}: not tried ({reason})")
            continue
        for trial in TRIALS[kind](inputs, root / kind, modes, quick, rng):
            rep.tried += 1
            if trial.ok:
                rep.nothing_lost += 1
            else:
                rep.failures.append(f"{trial.name}: {trial.detail}")
            log(f"{kind:9s} {trial.name:40s} {'ok' if trial.ok else 'LOST: ' + trial.detail}")
    return reports


def main(argv: list[str] | None = None) -> int:
    """Run the trials (or the soak) and print a summary (``--json``: one JSON object).

    Returns:
        0 when every trial tried lost nothing (or the soak met its bounds), else 1.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="the CI subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--soak", type=int, metavar="STEPS", default=0, help="run the soak instead")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="outcore-trials-"))
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    t0 = time.time()
    try:
        if args.soak:
            result = soak(build_inputs(root / "inputs"), root / "soak", args.soak)
            ok = result["ok"]
        else:
            only = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
            bad = [k for k in only if k not in KINDS]
            if bad:
                p.error(f"unknown kind {bad[0]!r}; choose from {', '.join(KINDS)}")
            reports = run_trials(root, args.quick, args.seed, only, log)
            result = {k: asdict(r) for k, r in reports.items()}
            ok = all(r.tried == r.nothing_lost for r in reports.values())
    finally:
        unmount_all()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = {"ok": ok, "seed": args.seed, "quick": args.quick, "wall_s": round(time.time() - t0, 1),
              "results": result}
    if args.json:
        emit_json(json.dumps(result, indent=1))
    else:
        for kind, r in result["results"].items() if not args.soak else []:
            print(f"{kind:9s} tried {r['tried']:3d}  nothing lost {r['nothing_lost']:3d}"
                  + (f"  (not tried: {r['not_tried']})" if r["not_tried"] else ""))
        if args.soak:
            print(json.dumps(result["results"], indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        raise SystemExit(main())
