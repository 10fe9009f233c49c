"""Full fine-tuning of a model far larger than the RAM it uses: SmolLM2-1.7B dimensions.

The model is built on the meta device; each unit is initialized (random, seeded)
straight into the tiered store, so the whole model never exists in RAM. Weights
and optimizer state live on NVMe; blocks are recomputed in the backward; the loss
is the chunked LM-head loss. Prints step time, bytes moved per step (as the storage
layer saw them, /proc/self/io) and peak RSS.

    python scripts/bench_big.py --json                 # 1.7B, AdamW8bit, 3 steps
    python scripts/bench_big.py --layers 4 --steps 2   # a quick check
    python scripts/bench_big.py --method qlora --dtype bfloat16 --json
                     # QLoRA: the frozen base streams as NF4, adapters resident

``--method lora|qlora`` puts peft adapters (rank 16) on every linear layer of the
blocks; their AdamW state stays in RAM and nothing is written back to NVMe.
``--dtype bfloat16`` computes in bf16 (full fine-tune: with fp32 master weights in
the state tier).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _measure import storage_io  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="decoder blocks (SmolLM2-1.7B: 24)")
    ap.add_argument("--optim", default="adamw8bit", help="optimizer name (as --optim of outcore finetune)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--activations", default="recompute", help="keep | recompute | offload")
    ap.add_argument("--swap-dir", default=None, help="parent of the swap directory (default: tmp)")
    ap.add_argument("--method", default="full", choices=("full", "lora", "qlora"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outcore.activations import apply_activation_policy
    from outcore.kernels import CausalLMHeadLoss
    from outcore.models import add_lora, plain_name
    from outcore.models._lazy import materialize_buffers
    from outcore.offload import offload_model
    from outcore.optim import build_optimizer

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                      rope_theta=130000.0, tie_word_embeddings=True, use_cache=False)
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    materialize_buffers(model, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    base, adapters = model, args.method != "full"
    if adapters:
        model = add_lora(model, r=16, alpha=32, dropout=0.0, seed=0,
                         targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def init(slot, out):  # seeded per parameter: the same model every run
        g = torch.Generator().manual_seed(zlib.crc32(plain_name(slot.name).encode()))
        if out.dim() >= 2:
            out.normal_(0.0, 0.02, generator=g)
        else:
            out.fill_(1.0)

    head = CausalLMHeadLoss(base.lm_head)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)  # before the engine empties streamed parameters
    opt = (torch.optim.AdamW(trainable, lr=1e-4, fused=True) if adapters
           else build_optimizer(args.optim, trainable, lr=1e-5, weight_decay=0.0))
    swap = tempfile.mkdtemp(prefix="bench_big_", dir=args.swap_dir)
    t0 = time.perf_counter()
    om = offload_model(model, opt, offload="nvme", swap_dir=os.path.join(swap, "swap"), prefetch=args.prefetch,
                       head_modules=[head], init_weights=init, resident_trainable=adapters,
                       quantize_frozen=args.method == "qlora")
    setup_s = time.perf_counter() - t0
    if args.activations != "keep":
        apply_activation_policy(base, args.activations)

    def loss_fn(m, ids):
        return head(base.model(input_ids=ids).last_hidden_state, ids)

    g = torch.Generator().manual_seed(0)
    times, reads, writes, losses = [], [], [], []
    for step in range(args.steps + 1):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        r0, w0 = storage_io()
        t = time.perf_counter()
        losses.append(float(om.train_step(loss_fn, [ids], 1e-5)))
        dt = time.perf_counter() - t
        r1, w1 = storage_io()
        if step > 0:  # the first step is the warm-up
            times.append(dt)
            reads.append(r1 - r0)
            writes.append(w1 - w0)
        if not args.json:
            print(f"step {step}: {dt:.1f} s, loss {losses[-1]:.4f}, read {(r1 - r0) / 1e9:.2f} GB, "
                  f"written {(w1 - w0) / 1e9:.2f} GB", file=sys.stderr, flush=True)
    om.close()
    shutil.rmtree(swap, ignore_errors=True)  # close() removed the swap files; their folder goes too
    out = {
        "params": n_params, "layers": args.layers, "method": args.method, "dtype": args.dtype,
        "trainable_params": n_trainable,
        "optim": "adamw (adapters, resident)" if adapters else args.optim, "seq_len": args.seq,
        "batch_size": args.batch, "activations": args.activations, "setup_s": setup_s,
        "median_step_s": statistics.median(times), "min_step_s": min(times), "max_step_s": max(times),
        "bytes_read_per_step": int(statistics.median(reads)), "bytes_written_per_step": int(statistics.median(writes)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "weights_bytes": n_params * 4, "losses": losses, "threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=1) if args.json else
          f"{n_params / 1e9:.2f}B params ({out['weights_bytes'] / 2**30:.1f} GiB fp32 weights): "
          f"{out['median_step_s']:.1f} s/step, peak RSS {out['peak_rss_bytes'] / 2**30:.2f} GiB, "
          f"{out['bytes_read_per_step'] / 1e9:.1f} GB read / {out['bytes_written_per_step'] / 1e9:.1f} GB written per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
