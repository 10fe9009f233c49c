"""``scripts/bench_step.py --regime disk``: a step the disk, not the compute, should set.

On a real GPU the disk sets the step time; on a CPU the compute usually hides the I/O.
A shape with little compute per byte reproduces the GPU's regime here: SmolLM2-1.7B's
dimensions (``--layers`` of its blocks), bf16 compute with fp32 master weights and
AdamW8bit state, sequence 32, batch 1, everything authoritative on NVMe, trained by
outcore out of core exactly as a user gets it (scripts/_bench_outcore.py).

One run, on the swap directory's disk:

1. the plan's budgets measured as ``outcore doctor`` measures them, and the plan's estimate;
2. warm-up steps, then per timed step, interleaved (the box is shared: other jobs' I/O and
   CPU load change from minute to minute, so each step is set against the disk as it was
   then): the step, with the bytes that reached the storage layer (``/proc/self/io``) and
   the store's stall; the same step with everything in RAM (offload cpu, when it fits in
   half the free RAM): the compute floor, what the step costs with no disk at all; the
   disk's sequential ``O_DIRECT`` read and write bandwidth (fio,
   1 MiB, else dd: scripts/bench_io.py's rounds); a round reading and writing at once;
   the load average.

The disk-limited time of a step is what the disk alone needs for the bytes that step
moved: ``read / read bandwidth + written / write bandwidth`` when the device shares one
bandwidth between a concurrent read and write (``serial``), ``max()`` of the two when
it serves both at full speed (``concurrent``); which one holds is measured (the
concurrent round's time against the two alone's) and reported. ``ratio`` is the median
step over the median disk-limited time (the issue asks for <= 1.15).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from outcore.cli.jsonout import emit_json

from _measure import storage_io

#: the disk-bound shape's numerics (the model is bench_step's smol-1.7b-random, ``--layers`` blocks)
DTYPE, OPTIM = "bfloat16", "adamw8bit"
#: bytes each disk round writes and reads (as much as a few units: long enough to be the disk's rate)
ROUND_BYTES = 1 << 30


def disk_model(alone_s: float, together_s: float, parallel_s: float) -> str:
    """``serial`` or ``concurrent``: which sum the disk's time for a read and a write follows.

    Args:
        alone_s: the read and the write one after the other (their times added).
        together_s: the same read and write issued at once.
        parallel_s: the longer of the two alone (what a disk serving both at full speed takes).

    Returns:
        ``concurrent`` when running them together saved more than half of what full
        concurrency would save, else ``serial``.
    """
    saved, possible = alone_s - together_s, alone_s - parallel_s
    return "concurrent" if possible > 0 and saved > possible / 2 else "serial"


def disk_limited_s(read_bytes: int, write_bytes: int, read_gbps: float, write_gbps: float, model: str) -> float:
    """Seconds the disk alone needs to read ``read_bytes`` and write ``write_bytes`` (``model``: see above)."""
    r, w = read_bytes / (read_gbps * 1e9), write_bytes / (write_gbps * 1e9)
    return max(r, w) if model == "concurrent" else r + w


def _disk_rounds(work: Path) -> dict[str, float]:
    """The disk's bandwidths now: sequential read and write alone, then both at once."""
    from bench_io import dd_concurrent_round, dd_round, fio_round

    alone = fio_round(work, ROUND_BYTES, 8) if shutil.which("fio") else dd_round(work, ROUND_BYTES)
    both = dd_concurrent_round(work, ROUND_BYTES)
    r_s, w_s = both["read_bytes"] / (alone["read_gbps"] * 1e9), both["write_bytes"] / (alone["write_gbps"] * 1e9)
    return {"read_gbps": alone["read_gbps"], "write_gbps": alone["write_gbps"], "alone_s": r_s + w_s,
            "together_s": both["seconds"], "parallel_s": max(r_s, w_s)}


def _timed_steps(trainer, in_ram, batches: list, warmup: int, work: Path) -> list[dict[str, Any]]:
    """Warm up, then per timed step: the step, its bytes and stall, the same step with everything
    in RAM (``in_ram``: the compute floor, no disk), the disk's rounds, the load."""
    for ids in batches[:warmup]:
        trainer.step(ids)
        if in_ram is not None:
            in_ram.step(ids)
    store, rows, starts, dd = trainer.offloaded.store, [], [], []
    for ids in batches[warmup:]:
        starts.append(storage_io())
        stall0 = store.stall_s
        t0 = time.perf_counter()
        loss = trainer.step(ids)
        dt = time.perf_counter() - t0
        row = {"step_s": dt, "loss": loss, "stall_s": store.stall_s - stall0, "load_1m": os.getloadavg()[0]}
        if in_ram is not None:
            t0 = time.perf_counter()
            row["in_ram_loss"] = in_ram.step(ids)
            row["in_ram_step_s"] = time.perf_counter() - t0
        d0 = storage_io()
        row.update(_disk_rounds(work))
        d1 = storage_io()
        dd.append((d1[0] - d0[0], d1[1] - d0[1]))  # a reaped child's I/O counts in its parent's
        rows.append(row)
    # A step's bytes run from its start to the next one's, less the disk rounds' (dd): its
    # write-behind goes on after it returns, while the rest of the row is measured.
    trainer.offloaded.mem.flush()
    starts.append(storage_io())
    for row, (r0, w0), (r1, w1), (dr, dw) in zip(rows, starts, starts[1:], dd):
        row["read_bytes"], row["write_bytes"] = r1 - r0 - dr, w1 - w0 - dw
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the timed steps and the disk, the disk-limited time and the step's ratio to it."""
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    votes = [disk_model(r["alone_s"], r["together_s"], r["parallel_s"]) for r in rows]
    model = max(("serial", "concurrent"), key=votes.count)
    limits = [disk_limited_s(r["read_bytes"], r["write_bytes"], r["read_gbps"], r["write_gbps"], model)
              for r in rows]
    out = {"median_step_s": med("step_s"), "min_step_s": min(r["step_s"] for r in rows),
           "max_step_s": max(r["step_s"] for r in rows), "bytes_read_per_step": int(med("read_bytes")),
           "bytes_written_per_step": int(med("write_bytes")), "median_stall_s": med("stall_s"),
           "disk_read_gbps": med("read_gbps"), "disk_write_gbps": med("write_gbps"), "disk_model": model,
           "disk_concurrent_saving": 1 - med("together_s") / med("alone_s"),
           "disk_limited_s": statistics.median(limits), "load_1m": [r["load_1m"] for r in rows],
           "steps": rows}
    out["ratio"] = out["median_step_s"] / out["disk_limited_s"]
    if all("in_ram_step_s" in r for r in rows):
        out["in_ram_median_step_s"] = med("in_ram_step_s")
        out["ratio_vs_in_ram"] = out["median_step_s"] / out["in_ram_median_step_s"]
    return out


def run_disk_regime(args) -> int:
    """``bench_step.py --regime disk``: measure, print JSON (``--json``) or a short table. Returns 0."""
    import psutil
    import torch

    from _bench_outcore import OutcoreTrainer
    from _bench_plan import measured_budgets, plan_error, plan_estimate
    from bench_step import HYPER, make_batches, model_config

    from outcore.errors import OutcoreError

    torch.set_num_threads(args.threads)
    config = model_config("smol-1.7b-random", args.layers)
    budgets = measured_budgets(args.swap_dir)  # what `outcore doctor` measures, before the run
    estimate = plan_estimate(config, budgets, offload="nvme", optim=OPTIM, dtype=DTYPE, seq=args.seq,
                             batch=args.batch, activations=args.activations)
    # The same step with everything in RAM, when it fits in half of what is free: the compute floor
    in_ram = plan_estimate(config, budgets, offload="cpu", optim=OPTIM, dtype=DTYPE, seq=args.seq,
                           batch=args.batch, activations=args.activations)
    in_ram_fits = in_ram.get("expected_peak_rss_bytes", 1 << 62) < psutil.virtual_memory().available / 2
    batches = make_batches(args.warmup + args.steps, args.batch, args.seq, config.vocab_size)
    work = Path(tempfile.mkdtemp(prefix="bench_disk_", dir=args.swap_dir))
    trainers = []

    def build(offload: str):
        trainers.append(OutcoreTrainer("smol-1.7b-random", config, args.seed, offload=offload, optim=OPTIM,
                                       seq_len=args.seq, batch_size=args.batch, hyper=HYPER, work_dir=str(work),
                                       activations=args.activations, dtype=DTYPE, budgets=budgets))
        return trainers[-1]
    try:
        trainer = build("nvme")
        rows = _timed_steps(trainer, build("cpu") if in_ram_fits else None, batches, args.warmup, work)
        prefetch = trainer.plan.prefetch_depth
    except OutcoreError as e:  # e.g. the RAM free now does not hold the windows: a result, not a figure
        emit_json(json.dumps({"regime": "disk", "status": "unavailable", "reason": str(e), "plan_estimate": estimate}))
        return 0
    finally:
        for t in trainers:
            t.close()
        shutil.rmtree(work, ignore_errors=True)
    result = {"regime": "disk", "model": "smol-1.7b-random", "layers": config.num_hidden_layers, "dtype": DTYPE,
              "optim": OPTIM, "seq_len": args.seq, "batch_size": args.batch, "warmup": args.warmup,
              "threads": args.threads, "prefetch_depth": prefetch, **summarize(rows), "status": "ok",
              "plan_estimate": estimate, "plan_estimate_in_ram": in_ram, "budgets": budgets.to_dict(),
              "machine": {"cpus": os.cpu_count(), "swap_dir": args.swap_dir}}
    result["plan_error"] = plan_error(estimate, result)
    if args.json:
        emit_json(json.dumps(result, indent=1))
    else:
        print(_table(result))
    return 0


def _table(r: dict[str, Any]) -> str:
    gb, est, err = 1e9, r["plan_estimate"], r["plan_error"]
    return "\n".join([
        f"disk regime: {r['layers']} blocks of SmolLM2-1.7B, {r['dtype']} + fp32 masters, {r['optim']}, "
        f"seq {r['seq_len']} batch {r['batch_size']}, prefetch k={r['prefetch_depth']}, "
        f"load {min(r['load_1m']):.1f}-{max(r['load_1m']):.1f}",
        f"step median {r['median_step_s']:.2f} s (min {r['min_step_s']:.2f}, max {r['max_step_s']:.2f}), "
        f"stall {r['median_stall_s']:.2f} s",
        f"moved per step: read {r['bytes_read_per_step'] / gb:.2f} GB, "
        f"written {r['bytes_written_per_step'] / gb:.2f} GB",
        f"disk: read {r['disk_read_gbps']:.2f} GB/s, write {r['disk_write_gbps']:.2f} GB/s, {r['disk_model']} "
        f"(read+write at once saved {r['disk_concurrent_saving']:.0%})",
        f"disk-limited step {r['disk_limited_s']:.2f} s; ratio step / disk limit {r['ratio']:.3f}",
        "the same step all in RAM (no disk): " + (f"{r['in_ram_median_step_s']:.2f} s, step / it "
                                                   f"{r['ratio_vs_in_ram']:.3f}" if "in_ram_median_step_s" in r
                                                   else "not run: it does not fit in half the free RAM"),
        "plan estimate: " + (est.get("error") or f"{est['step_s']:.2f} s (disk {est['disk_s']:.2f} s, compute "
                                                  f"{est['compute_s']:.2f} s, update {est['update_s']:.2f} s), "
                                                  f"{'n/a' if err is None else f'{err:+.0%}'} vs measured"),
    ])


if __name__ == "__main__":
    sys.exit("run it as: python scripts/bench_step.py --regime disk")
