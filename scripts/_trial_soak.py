"""The soak of ``scripts/trial_faults.py --soak STEPS``: a long out-of-core run, watched.

The real CLI trains the tiny Llama for STEPS steps from NVMe (no eval, no checkpoint but
the last, no export) while this process samples, every 0.2 s, from ``/proc/PID``: the
resident set, open file descriptors and threads, and the swap files' size and blocks on
disk, with the step the run has logged. After the warm-up (the first 10% of steps, at
least 20) the run must hold: RSS drift <= 2% (median of the last 5 samples against the
median of the first 5), file descriptors and threads constant, the swap files neither
longer nor larger on disk; after exit, code 0, no swap directory and no ``*.tmp`` left.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from _trial_run import Inputs, debris, finetune_args, finish, start, steps_logged

MAX_RSS_DRIFT = 0.02


def _sample(pid: int, swap: Path) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # the process has just ended
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie: exited, not yet reaped
        return None
    files = [f for f in swap.glob("*") if f.is_file()] if swap.is_dir() else []
    stats = [f.stat() for f in files]
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"]), "fds": fds,
            "swap_size": sum(s.st_size for s in stats), "swap_disk": sum(s.st_blocks * 512 for s in stats)}


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
        time.sleep(0.2)
    done = finish(proc, log)
    warm = max(steps // 10, 20)
    after = [s for s in samples if warm <= s["step"] < steps]
    result = {"steps": steps, "rc": done.rc, "wall_s": round(time.time() - t0, 1), "warmup_steps": warm,
              "samples_after_warmup": len(after)}
    if len(after) < 10:
        return {**result, "ok": False, "why": "fewer than 10 samples after warm-up", "stderr": done.err[-500:]}
    rss0 = statistics.median(s["rss"] for s in after[:5])
    rss1 = statistics.median(s["rss"] for s in after[-5:])
    result.update({
        "rss_after_warmup_mib": round(rss0 / 2**20, 1), "rss_end_mib": round(rss1 / 2**20, 1),
        "rss_drift": round((rss1 - rss0) / rss0, 4),
        "rss_max_over_start": round((max(s["rss"] for s in after) - rss0) / rss0, 4),
        "fds": sorted({s["fds"] for s in after}), "threads": sorted({s["threads"] for s in after}),
        "swap_size_bytes": sorted({s["swap_size"] for s in after}),
        "swap_disk_bytes": sorted({s["swap_disk"] for s in after}),
        "swap_dir_left": (out / "swap").exists(), "tmp_left": debris(out)})
    result["ok"] = (done.rc == 0 and result["rss_drift"] <= MAX_RSS_DRIFT and len(result["fds"]) == 1
                    and len(result["threads"]) == 1 and len(result["swap_size_bytes"]) == 1
                    and len(result["swap_disk_bytes"]) == 1 and not result["swap_dir_left"]
                    and not result["tmp_left"])
    return result
