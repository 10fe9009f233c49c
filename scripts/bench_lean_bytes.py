"""Bytes written per trainable parameter per step, and the swap file's footprint, out of core.

Issue #14, item 3: the write-lean mode (``precision=bf16-lean``: bf16 weights, no fp32
master, AdamW8bit) should write at most ~4 B per parameter per step (DeepSpeed's ZeRO-Infinity:
15.8 B; exact fp32 AdamW: 12 B of weights and moments at least) and hold ~4 B per parameter on
disk. This trains the default model (SmolLM2-135M) with its weights and optimizer state on NVMe
(``offload=nvme``, step-in-backward: no clipping, so no gradient is spilled to disk) and
measures, over ``--steps`` steps after one warm-up step:

* ``store_written_per_param_step`` — the store's own NVMe write counter (``tier_stats()``:
  every write-back, each 4 KiB-padded extent), per trainable parameter per step;
* ``os_written_per_param_step`` — ``/proc/self/io`` ``write_bytes`` (what reached the block
  layer from this process: the extents, and the swap directory's journal);
* ``disk_per_param`` — the swap file's extents held on NVMe after training
  (``tier_stats()["NVME"].held_bytes``), per parameter, and the file's allocated blocks
  (``st_blocks``, see docs/architecture.md §3).

Measured (2026-11-24, SmolLM2-135M, 134,515,008 parameters, bf16-lean AdamW8bit, 2 steps):
3.99996 B written per parameter per step by the store's counter and 4.00002 by
``/proc/self/io`` (the journal's lines); 3.99996 B per parameter held on NVMe, 3.99999
allocated (the swap file is trimmed to its extents once the units are stored; before, a 1/16
cushion: 4.258). 2 B of bf16 weight and 2 x 1 B of 8-bit moments: the block absmax, step
counts and small tensors' moments stay in RAM (``unit_sizes.ram_kinds``); before they did, 4.039.

    python scripts/bench_lean_bytes.py [--precision bf16-lean] [--optim adamw8bit] [--steps 2]
        [--swap-dir DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import storage_io


def measure(args) -> dict:
    """Train the default model out of core as ``args`` say; the byte figures."""
    from outcore.data import BatchLoader, build_datasets
    from outcore.dtypes import EXACT
    from outcore.models import load_model
    from outcore.offload.engine import offload_model
    from outcore.optim import build_optimizer, with_precision

    dtype = torch.float32 if args.precision == EXACT and args.dtype == "float32" else torch.bfloat16
    model, tok = load_model("default", dtype=dtype)
    model.config.use_cache = False
    train, _ = build_datasets("default", tok, args.seq_len)
    loader = BatchLoader(train, batch_size=args.batch_size, seed=0)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = with_precision(build_optimizer(args.optim, model.parameters(), lr=5e-5, weight_decay=0.0),
                         args.precision, seed=0)
    om = offload_model(model.train(), opt, offload="nvme", swap_dir=args.swap_dir, prefetch=2)

    def step() -> None:
        batch = loader.next_batch()
        om.train_step(lambda m, b: m(**b).loss, [batch], 5e-5)
        om.mem.flush()  # the step's write-backs are durable: all of them counted

    step()  # warm-up: the first write-backs replace the initial extents like every later one
    written0, (_, os0), t0 = om.tier_stats()["NVME"].written_bytes, storage_io(), time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - t0
    stats = om.tier_stats()["NVME"]
    swap_file = Path(args.swap_dir) / "extents.bin"
    allocated = os.stat(swap_file).st_blocks * 512 if swap_file.exists() else 0
    out = {"precision": args.precision, "optim": args.optim, "dtype": str(dtype).split(".")[-1],
           "trainable_params": n, "steps": args.steps, "s_per_step": elapsed / args.steps,
           "store_written_per_param_step": (stats.written_bytes - written0) / n / args.steps,
           "os_written_per_param_step": (storage_io()[1] - os0) / n / args.steps,
           "disk_held_per_param": stats.held_bytes / n, "swap_file_allocated_per_param": allocated / n}
    om.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from outcore.dtypes import BF16_LEAN, PRECISIONS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=PRECISIONS, default=BF16_LEAN)
    ap.add_argument("--optim", default="adamw8bit")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's dtype with --precision exact (bf16-lean is always bfloat16)")
    ap.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up step)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--swap-dir", default="/tmp/outcore-lean-bytes", help="on the disk to measure")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the default)")
    ap.add_argument("--json", metavar="OUT", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = measure(args)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
