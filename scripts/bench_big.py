"""Full fine-tuning of a model far larger than the RAM it uses: SmolLM2-1.7B or Llama-3-8B shape.

The model is built on the meta device; each unit is initialized (random, seeded)
straight into the tiered store, so the whole model never exists in RAM. Weights
and optimizer state live on NVMe; blocks are recomputed in the backward; the loss
is the chunked LM-head loss. The run is set up by the recipe's own builders from a
``FinetuneConfig`` (``plan_this_run``, ``optimizer_for_config``, ``offload_from_plan``), so what
the plan estimates is what the engine is given. Prints step time, bytes moved per step
(as the storage layer saw them, /proc/self/io) and peak RSS, each beside the plan's
estimate.

    python scripts/bench_big.py --json                 # 1.7B, AdamW8bit, 3 steps
    python scripts/bench_big.py --layers 4 --steps 2   # a quick check
    python scripts/bench_big.py --shape llama3-8b --dtype bfloat16 --layers 4 --json
                     # Llama-3.1-8B's shape (vocab 128256, untied head), 4 of its 32 blocks
    python scripts/bench_big.py --method qlora --dtype bfloat16 --json
                     # QLoRA: the frozen base streams as NF4, adapters resident
    python scripts/bench_big.py --shape llama3-70b --method qlora --dtype bfloat16 --layers 4 \
        --same-batch --lr 1e-3 --json     # Llama-3-70B's shape, 4 of its 80 blocks
    python scripts/bench_big.py --shape llama3-70b --method qlora --generate 4 --layers 4 --json
                     # generation: 4 tokens, the NF4 base streamed for each (Generator.generate)
    python scripts/bench_big.py --shape llama3-70b --method qlora --dtype bfloat16 --plan-only --json
                     # the plan alone (all 80 blocks: nothing is built or written)

``--method lora|qlora`` puts peft adapters (rank 16) on every linear layer of the
blocks; their AdamW state stays in RAM and nothing is written back to NVMe.
``--generate N`` runs no training: the model (its blocks' matrices in NF4 unless ``--method
full``) streams through ``StreamedInference`` and ``recipes.generate.Generator`` generates N
tokens greedily from a short prompt (the default model's tokenizer), as ``outcore generate``
does once the model is loaded. ``--same-batch`` trains every step on one batch (its loss must
fall). ``--dtype bfloat16`` computes in bf16 (full fine-tune: with fp32 master weights in
the state tier). ``--precision P`` and ``--set KEY=VALUE`` pass config keys through to
the ``FinetuneConfig`` (an unknown key is refused by the config, as on the command line).
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

from outcore.cli.jsonout import emit_json, json_stdout
from outcore.planner.largest import REFERENCE_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _measure import storage_io


SHAPES = REFERENCE_SHAPES  # planner/largest.py: the shapes the plan sizes for `outcore doctor`


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-1.7b", choices=tuple(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the shape's)")
    ap.add_argument("--optim", default="adamw8bit", help="optimizer name (as --optim of outcore finetune)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--prefetch", type=int, default=None, help="units fetched ahead (default: the plan's)")
    ap.add_argument("--activations", default="recompute", help="keep | recompute | offload")
    ap.add_argument("--swap-dir", default=None, help="parent of the swap directory (default: tmp)")
    ap.add_argument("--method", default="full", choices=("full", "lora", "qlora"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--precision", default=None, help="the config's precision= key (where this outcore has it)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another config override")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--same-batch", action="store_true", help="train every step on one batch")
    ap.add_argument("--generate", type=int, default=0, metavar="N", help="generate N tokens instead of training")
    ap.add_argument("--fast-init", action="store_true",
                    help="each matrix a window of one seeded N(0, 0.02) pool (70B: minutes, not half an hour)")
    ap.add_argument("--plan-only", action="store_true", help="print the plan's figures; build nothing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.plan_only:
        return _plan_only(args)

    from _rss_trace import RssTrace
    trace = RssTrace()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    swap = tempfile.mkdtemp(prefix="bench_big_", dir=args.swap_dir)
    try:
        trace.mark("setup")
        if args.generate:
            out = _generate(args, swap, trace)
        else:
            run, out = _setup(args, swap)
            out.update(_train(run, args, trace))
            run["engine"].close()
    finally:
        shutil.rmtree(swap, ignore_errors=True)  # close() removed the swap files; their folder goes too
    out["rss_phases"] = trace.stop()
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.json:
        emit_json(json.dumps(out, indent=1))
        return 0
    if args.generate:
        print(f"{out['params'] / 1e9:.2f}B params: {out['generate_s']:.1f} s for {out['new_tokens']} tokens "
              f"({out['s_per_token']:.1f} s/token), {out['bytes_read'] / 1e9:.1f} GB read, peak RSS "
              f"{out['peak_rss_bytes'] / 2**30:.2f} GiB")
        return 0
    print(f"{out['params'] / 1e9:.2f}B params ({out['weights_bytes'] / 2**30:.1f} GiB {args.dtype} weights): "
          f"{out['median_step_s']:.1f} s/step (plan {out['plan']['step_s']:.1f}), peak RSS "
          f"{out['peak_rss_bytes'] / 2**30:.2f} GiB (plan {out['plan']['peak_rss_bytes'] / 2**30:.2f}), "
          f"{out['bytes_read_per_step'] / 1e9:.1f} GB read / {out['bytes_written_per_step'] / 1e9:.1f} GB "
          f"written per step (plan {out['plan']['nvme_read_bytes'] / 1e9:.1f} / "
          f"{out['plan']['nvme_write_bytes'] / 1e9:.1f})")
    return 0


def _config(args: argparse.Namespace, swap: str):
    """The run's FinetuneConfig: the benchmark's settings, then ``--precision`` and ``--set``."""
    from outcore.training.config import load_config

    keys = dict(method=args.method, optim=args.optim, dtype=args.dtype, seq_len=args.seq, batch_size=args.batch,
                activations=args.activations, offload="nvme", max_grad_norm=0.0, grad_accum=1, lr=args.lr,
                weight_decay=0.0, lora_r=16, lora_alpha=32, swap_dir=os.path.join(swap, "swap"),
                output=os.path.join(swap, "out"),
                lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    extra = list(args.set) + ([f"precision={args.precision}"] if args.precision else [])
    return load_config(overrides=[f"{k}={v}" for k, v in keys.items() if k != "lora_targets"] + extra,
                       lora_targets=keys["lora_targets"])


def _setup(args: argparse.Namespace, swap: str) -> tuple[dict, dict]:
    """Build the meta model, plan it and hand it to the engine; (the run's objects, the result so far)."""
    import dataclasses

    import torch
    from outcore.activations import apply_activation_policy
    from outcore.kernels import CausalLMHeadLoss
    from outcore.offload.store import probe_hardware
    from outcore.planner import budgets_from_probe, plan_for_config
    from outcore.training.build import offload_from_plan, optimizer_for_config, with_lora

    cfg = _config(args, swap)
    model, hf = _meta_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    base = model
    if cfg.uses_adapters:
        model = with_lora(model, cfg)
    # RAM budgets far above the need: the plan sizes the windows (what is measured here) and
    # does not refuse the run for what other processes hold at the moment; speeds: fallbacks
    probe = probe_hardware(swap, measure=False)
    plan = plan_for_config(cfg, model, budgets=dataclasses.replace(
        budgets_from_probe(probe), device_bytes=1 << 40, host_bytes=1 << 40, ram_bytes=1 << 40))
    if args.prefetch:
        plan = dataclasses.replace(plan, prefetch_depth=args.prefetch)
    head = CausalLMHeadLoss(base.lm_head)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)  # before the engine empties streamed parameters
    opt = optimizer_for_config(cfg, trainable, streaming=True)
    t0 = time.perf_counter()
    fill = _fast_init if args.fast_init else _init
    engine = offload_from_plan(cfg, model, opt, plan, Path(cfg.output), head_loss=head, fill=fill)
    setup_s = time.perf_counter() - t0
    if args.activations != "keep":
        apply_activation_policy(base, args.activations)
    out = {
        "shape": args.shape, "params": n_params, "layers": hf.num_hidden_layers, "method": args.method,
        "dtype": args.dtype,
        "config_overrides": list(args.set) + ([f"precision={args.precision}"] if args.precision else []),
        "trainable_params": n_trainable, "optim": cfg.optim, "lr": args.lr, "same_batch": args.same_batch,
        "fast_init": args.fast_init,
        "seq_len": args.seq, "batch_size": args.batch,
        "activations": args.activations, "prefetch": plan.prefetch_depth, "setup_s": setup_s,
        "weights_bytes": n_params * torch.empty((), dtype=getattr(torch, args.dtype)).element_size(),
        "plan": {"peak_rss_bytes": plan.expected_peak_rss_bytes, "step_s": plan.time.step_s,
                 "nvme_read_bytes": plan.time.io_bytes["nvme_read"],
                 "nvme_write_bytes": plan.time.io_bytes["nvme_write"],
                 "tier_bytes": plan.tier_bytes},
    }
    return {"engine": engine, "base": base, "head": head, "vocab": hf.vocab_size}, out


def _meta_model(args: argparse.Namespace, use_cache: bool = False):
    """The shape's model on the meta device (``--layers`` blocks, ``--dtype``), and its HF config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outcore.models._lazy import materialize_buffers

    shape = dict(SHAPES[args.shape])
    hf = LlamaConfig(**{**shape, "num_hidden_layers": args.layers or shape["num_hidden_layers"]},
                     use_cache=use_cache)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf).to(getattr(torch, args.dtype))
    materialize_buffers(model, hf)
    return model, hf


def _plan_only(args: argparse.Namespace) -> int:
    """The plan of the run ``args`` describe, for the whole shape or ``--layers`` of it: nothing built."""
    import dataclasses

    from outcore.offload.store import probe_hardware
    from outcore.planner import budgets_from_probe, plan_for_config

    cfg = _config(args, tempfile.gettempdir())
    model, hf = _meta_model(args)
    probe = probe_hardware(tempfile.gettempdir(), measure=False)
    plan = plan_for_config(cfg, hf, budgets=dataclasses.replace(  # (the disk too: a plan, whatever is free now)
        budgets_from_probe(probe), device_bytes=1 << 40, host_bytes=1 << 40, ram_bytes=1 << 40, nvme_bytes=1 << 50))
    out = {"shape": args.shape, "layers": hf.num_hidden_layers, "params": plan.params, "method": args.method,
           "plan": {"peak_rss_bytes": plan.expected_peak_rss_bytes, "step_s": plan.time.step_s,
                    "nvme_read_bytes": plan.time.io_bytes["nvme_read"],
                    "nvme_write_bytes": plan.time.io_bytes["nvme_write"], "tier_bytes": plan.tier_bytes}}
    if args.json:
        emit_json(json.dumps(out, indent=1))
    else:
        print(plan.table())
    return 0


def _generate(args: argparse.Namespace, swap: str, trace) -> dict:
    """Stream the model for inference and generate ``args.generate`` tokens, timed."""
    import torch

    from outcore.models import load_tokenizer
    from outcore.offload.engine import StreamedInference
    from outcore.recipes.generate import Generator

    model, hf = _meta_model(args, use_cache=True)
    n_params = sum(p.numel() for p in model.parameters())
    fill = _fast_init if args.fast_init else _init
    t0 = time.perf_counter()
    streamed = StreamedInference(model, offload="nvme", swap_dir=os.path.join(swap, "swap"),
                                 prefetch=args.prefetch or 1, init_weights=lambda slot, t: fill(slot.name, t),
                                 device="cpu", quantize_frozen=args.method != "full")
    setup_s = time.perf_counter() - t0
    try:
        gen = Generator(model, load_tokenizer("default"), streamed)
        trace.mark("generate")
        r0, _ = storage_io()
        t = time.perf_counter()
        with torch.no_grad():
            done = gen.generate(["The capital of France is"], max_new_tokens=args.generate, chat=False)
        dt = time.perf_counter() - t
        r1, _ = storage_io()
    finally:
        streamed.close()
    return {"shape": args.shape, "params": n_params, "layers": hf.num_hidden_layers, "dtype": args.dtype,
            "base": "float" if args.method == "full" else "nf4", "fast_init": args.fast_init,
            "setup_s": setup_s, "generate_s": dt,
            "new_tokens": len(done[0].token_ids), "s_per_token": dt / max(1, len(done[0].token_ids)),
            "bytes_read": r1 - r0, "token_ids": done[0].token_ids, "threads": torch.get_num_threads()}


_POOL: list = []
POOL_NUMEL = 1 << 24  # 64 MiB of fp32 normals


def _fast_init(name: str, out) -> None:
    """As :func:`_init`, but a matrix is the pool from a per-name offset, repeated: a copy, where
    drawing 70B normals takes 15-30 minutes on two busy cores. Not independent draws: for
    throughput, memory and loss-goes-down checks only."""
    import torch

    if out.dim() < 2:
        out.fill_(1.0)
        return
    if not _POOL:
        _POOL.append(torch.empty(POOL_NUMEL).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0)))
    pool, flat, at = _POOL[0], out.view(-1), 0
    start = zlib.crc32(name.encode()) % POOL_NUMEL
    while at < flat.numel():
        n = min(flat.numel() - at, POOL_NUMEL - start)
        flat[at:at + n].copy_(pool[start:start + n])
        at, start = at + n, 0


def _init(name: str, out) -> None:
    """Seeded per parameter: the same model every run (matrices N(0, 0.02), norms 1)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if out.dim() >= 2:
        out.normal_(0.0, 0.02, generator=g)
    else:
        out.fill_(1.0)


def _train(run: dict, args: argparse.Namespace, trace) -> dict:
    """One warm-up step and ``args.steps`` timed ones: times, bytes per step and losses."""
    import torch

    base, head, om = run["base"], run["head"], run["engine"]

    def loss_fn(m, ids):
        return head(base.model(input_ids=ids).last_hidden_state, ids)

    g = torch.Generator().manual_seed(0)
    times, reads, writes, losses = [], [], [], []
    ids = torch.randint(0, run["vocab"], (args.batch, args.seq), generator=g)
    for step in range(args.steps + 1):
        trace.mark("warm-up" if step == 0 else "steps")
        if step and not args.same_batch:
            ids = torch.randint(0, run["vocab"], (args.batch, args.seq), generator=g)
        r0, w0 = storage_io()
        t = time.perf_counter()
        losses.append(float(om.train_step(loss_fn, [ids], args.lr)))
        dt = time.perf_counter() - t
        r1, w1 = storage_io()
        if step > 0:  # the first step is the warm-up
            times.append(dt)
            reads.append(r1 - r0)
            writes.append(w1 - w0)
        if not args.json:
            print(f"step {step}: {dt:.1f} s, loss {losses[-1]:.4f}, read {(r1 - r0) / 1e9:.2f} GB, "
                  f"written {(w1 - w0) / 1e9:.2f} GB", file=sys.stderr, flush=True)
    return {"median_step_s": statistics.median(times), "min_step_s": min(times), "max_step_s": max(times),
            "bytes_read_per_step": int(statistics.median(reads)),
            "bytes_written_per_step": int(statistics.median(writes)),
            "losses": losses, "threads": torch.get_num_threads()}


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        raise SystemExit(main())
