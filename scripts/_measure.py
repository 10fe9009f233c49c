"""What a benchmark measures of its own process: bytes that reached the storage layer, the
RSS high-water mark, and the median of timed steps after a warm-up (BENCHMARKING.md).

Shared by the scripts/bench_*.py children; scripts/ is not a package, so they import it
with scripts/ on sys.path.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def storage_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) that reached the storage layer for this process."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux clear_refs 5); False if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def time_steps(step: Callable[[Any], float], batches: list, warmup: int) -> dict[str, Any]:
    """Run ``warmup`` untimed steps then time the rest; measure storage I/O.

    Args:
        step: runs one optimizer step on a batch and returns its loss as a float.
        batches: the batches, in order; the first ``warmup`` are the warm-up.
        warmup: number of untimed steps.

    Returns:
        The per-mode result dict (wall and CPU times, losses, bytes per step).
    """
    losses = [step(b) for b in batches[:warmup]]
    times, cpu = [], []
    r0, w0 = storage_io()
    for b in batches[warmup:]:
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(b))  # step() returns a float: the step is finished when it returns
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    r1, w1 = storage_io()
    n = len(times)
    return {
        "status": "ok",
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "max_step_s": max(times),
        "step_times_s": times,
        # CPU seconds of all the process's threads per step: less sensitive than wall time to
        # other jobs on a shared machine (but blind to time spent waiting for the disk).
        "median_cpu_step_s": statistics.median(cpu),
        "bytes_read_per_step": (r1 - r0) // n,
        "bytes_written_per_step": (w1 - w0) // n,
        "losses": losses,
    }
