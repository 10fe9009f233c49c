"""This process's RSS over time, per phase, split into anonymous and file-backed pages.

Used by scripts/bench_step.py's children: the peak of each phase (imports, setup,
train) tells what a mode's peak RSS is made of.
"""
from __future__ import annotations

import threading
from pathlib import Path


def status_bytes(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes (VmRSS, VmHWM, RssAnon, RssFile …)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) * 1024
    return out


class RssTrace:
    """This process's RSS sampled every ``interval`` s by a thread, peak per phase.

    Each phase records its sampled peak split into anonymous memory (``RssAnon``:
    heap, arenas, tensors) and file-backed pages (``RssFile``: shared libraries,
    memory-mapped weight files), and the RSS when it ended. Sampling can miss a
    spike shorter than the interval; ``VmHWM`` does not (it is reported too).
    """

    KEYS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, interval: float = 0.005):
        self.interval, self.phase = interval, "imports"
        self.phases: dict[str, dict[str, int]] = {}
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> dict[str, int]:
        s = status_bytes(*self.KEYS)
        with self._lock:
            p = self.phases.setdefault(self.phase, {"peak_bytes": 0})
            if s["VmRSS"] > p["peak_bytes"]:
                p.update(peak_bytes=s["VmRSS"], peak_anon_bytes=s["RssAnon"], peak_file_bytes=s["RssFile"])
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def mark(self, phase: str) -> None:
        """End the current phase (record its final RSS) and start ``phase``."""
        s = self._sample()
        with self._lock:
            self.phases[self.phase].update(end_bytes=s["VmRSS"], end_anon_bytes=s["RssAnon"],
                                           end_file_bytes=s["RssFile"])
            self.phase = phase

    def stop(self) -> dict[str, dict[str, int]]:
        self.mark("done")
        self._stop.set()
        self._thread.join()
        return {k: v for k, v in self.phases.items() if k != "done"}
