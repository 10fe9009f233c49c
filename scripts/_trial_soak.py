"""The soak of ``scripts/trial_faults.py --soak STEPS``: a long out-of-core run, watched.

The real CLI trains the tiny Llama for STEPS steps from NVMe (no eval, no checkpoint but
the last, no export) while this process samples, every 0.1 s, from ``/proc/PID``: the
resident set, open file descriptors and threads, and the swap files' size and blocks on
disk, with the step the run has logged. After the warm-up (the first 10% of steps, at
least 20) the run must hold: RSS drift <= 2% (median of the last 5 samples against the
median of the first 5), as many open file descriptors and threads at the end as after the
warm-up (medians likewise: a descriptor open for an instant is not a leak), every swap
file (the extents file and its journal) neither longer nor larger on disk at the end than
after the warm-up; after exit, code 0, no swap directory and no ``*.tmp`` left.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from _trial_run import Inputs, debris, finetune_args, finish, start, steps_logged

MAX_RSS_DRIFT = 0.02
SAMPLE_S = 0.1  # between samples


def _sample(pid: int, swap: Path) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # the process has just ended
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie: exited, not yet reaped
        return None
    files = {f.name: f.stat() for f in swap.glob("*") if f.is_file()} if swap.is_dir() else {}
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"]), "fds": fds,
            "swap": {name: (st.st_size, st.st_blocks * 512) for name, st in files.items()}}


def soak(inputs: Inputs, root: Path, steps: int) -> dict:
    """Run the soak (see the module docstring).

    Args:
        inputs: the tiny model and data.
        root: where the run goes.
        steps: optimizer steps (1000 for the full soak).

    Returns:
        A JSON-able dict of the figures and ``ok``.
    """
    out = root / "run"
    args = finetune_args(inputs, out, "nvme", "--max-steps", str(steps), "save_every=0", "eval_every=0",
                         "log_every=5", "export=false")
    log = root / "soak.log"
    t0 = time.time()
    proc = start(args, log)
    samples: list[dict] = []
    while proc.poll() is None:
        step = steps_logged(out)
        s = _sample(proc.pid, out / "swap")
        if s is not None and step:
            samples.append({**s, "step": step})
        time.sleep(SAMPLE_S)
    done = finish(proc, log)
    warm = max(steps // 10, 20)
    after = [s for s in samples if warm <= s["step"] < steps]
    result = {"steps": steps, "rc": done.rc, "wall_s": round(time.time() - t0, 1), "warmup_steps": warm,
              "samples_after_warmup": len(after)}
    if len(after) < 10:
        return {**result, "ok": False, "why": "fewer than 10 samples after warm-up", "stderr": done.err[-500:]}
    first, last = after[:5], after[-5:]
    rss0, rss1 = (statistics.median(s["rss"] for s in part) for part in (first, last))
    result.update({
        "rss_after_warmup_mib": round(rss0 / 2**20, 1), "rss_end_mib": round(rss1 / 2**20, 1),
        "rss_drift": round((rss1 - rss0) / rss0, 4),
        "rss_max_over_start": round((max(s["rss"] for s in after) - rss0) / rss0, 4),
        **{f"{k}_{when}": statistics.median(s[k] for s in part) for k in ("fds", "threads")
           for when, part in (("after_warmup", first), ("end", last))},
        **{f"{k}_range": [min(s[k] for s in after), max(s[k] for s in after)] for k in ("fds", "threads")},
        # per swap file: (bytes long, bytes on disk) after the warm-up and at the end
        "swap_files": {name: {"after_warmup": first[-1]["swap"].get(name), "end": last[-1]["swap"].get(name)}
                       for name in sorted(set(first[-1]["swap"]) | set(last[-1]["swap"]))},
        "swap_dir_left": (out / "swap").exists(), "tmp_left": debris(out)})
    # a file "grows" when it ends longer than it ever was in the first half after the warm-up:
    # a file that only grows does; one that is bounded (the journal, compacted as it fills) does not
    half = after[:len(after) // 2]
    names = sorted({n for s in after for n in s["swap"]})
    peak = {n: max((s["swap"][n][0] for s in half if n in s["swap"]), default=0) for n in names}
    result["swap_files_max"] = {n: max(s["swap"][n][0] for s in after if n in s["swap"]) for n in names}
    grew = [n for n in names if last[-1]["swap"].get(n, (0,))[0] > peak[n]]
    result["swap_files_grown"] = grew
    result["ok"] = (done.rc == 0 and result["rss_drift"] <= MAX_RSS_DRIFT and not grew
                    and result["fds_end"] <= result["fds_after_warmup"]
                    and result["threads_end"] <= result["threads_after_warmup"]
                    and not result["swap_dir_left"] and not result["tmp_left"])
    return result
