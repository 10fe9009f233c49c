"""This process's CPU threads and memory readings (the RSS a step event reports)."""
from __future__ import annotations

import os
import resource
import sys

import psutil
import torch


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads for torch (0 = every core)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def ram_total_bytes() -> int:
    return psutil.virtual_memory().total
