#!/usr/bin/env python3
"""Peak RSS per phase of one outcore step on the default model (fp32, batch 1): where a step peaks.

Runs ``bench_long_context.py``'s outcore trainer in this process with a thread sampling the RSS
every 2 ms, tagged by the phase the step is in: ``forward`` (the blocks), ``loss`` (the chunked
head loss, which takes its gradients in the forward), ``after_loss`` (the final norm's backward),
``block_backward`` (inside a tiled block's backward, ``activations/tiled_block.py``) and
``between_blocks``. Printed beside the plan's expected peak (``layout.activation_bytes`` holds
the larger of the loss's phase and the blocks' backward). glibc's mmap threshold is fixed at
128 KiB, as in ``bench_long_context.py``, so freed tensors leave the RSS.

    python scripts/trace_step_phases.py 8192 recompute_nvme [--seq-tile auto]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seq_len", type=int)
    ap.add_argument("activations", choices=("recompute", "recompute_nvme"))
    ap.add_argument("--seq-tile", default="auto", help="tokens per tile (auto | 0 | N), as outcore's seq_tile")
    args = ap.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import psutil
    import torch
    from _bench_outcore import OutcoreTrainer

    from outcore.activations import tiled_block

    proc, phase, peaks = psutil.Process(), ["load"], {}

    def sample() -> None:
        while True:
            rss, p = proc.memory_info().rss, phase[0]
            peaks[p] = max(peaks.get(p, 0), rss)
            time.sleep(0.002)
    threading.Thread(target=sample, daemon=True).start()

    backward = tiled_block.TiledBlock.backward

    def tagged_backward(ctx, grad):
        phase[0] = "block_backward"
        try:
            return backward(ctx, grad)
        finally:
            phase[0] = "between_blocks"
    tiled_block.TiledBlock.backward = staticmethod(tagged_backward)
    hyper = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    trainer = OutcoreTrainer("default", None, 0, offload="nvme", optim="adamw", seq_len=args.seq_len, batch_size=1,
                             hyper=hyper, work_dir=tempfile.gettempdir(), activations=args.activations,
                             seq_tile=args.seq_tile)
    loss = trainer.head_loss.forward

    def tagged_loss(*a, **k):
        phase[0] = "loss"
        try:
            return loss(*a, **k)
        finally:
            phase[0] = "after_loss"
    trainer.head_loss.forward = tagged_loss
    try:
        loaded = proc.memory_info().rss
        ids = torch.randint(3, 49152, (1, args.seq_len), generator=torch.Generator().manual_seed(args.seq_len))
        phase[0] = "forward"
        trainer.step(ids)
        phase[0] = "done"
        time.sleep(0.05)
        print(json.dumps({"seq_len": args.seq_len, "activations": args.activations, "seq_tile": args.seq_tile,
                          "loaded_mib": loaded >> 20, "plan_mib": trainer.plan.expected_peak_rss_bytes >> 20,
                          "peak_mib": {k: v >> 20 for k, v in peaks.items()}}))
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
