"""Out-of-core training steps on an accelerator: a Llama shape with synthetic tokens.

The model is built on the meta device and each unit is initialized (random, seeded)
straight into the tiered store (``bench_big.py``'s builders); the DEVICE tier is the GPU,
capped at a consumer card's memory (``--device-mem``: the process's allocator fraction and
the DEVICE budget), and the weights and optimizer state live in HOST (``--offload cpu``)
or on NVMe. Reports, beside the plan's estimate: tokens/s and model TFLOPS, the I/O stall
share of the step, bytes per link per step (as the store counted them), GPU and host
peaks, the step's physical floor — max(compute at the measured matmul rate, disk bytes at
the measured disk rate, copy bytes at the measured copy rate) — and every step's loss in
hex (``gpu_proof.sh``'s race check compares them bit for bit).

    python scripts/bench_gpu_step.py --device cuda --shape 1.7b --json
    python scripts/bench_gpu_step.py --device cuda --shape 8b --blocks 4 --offload nvme --json
    python scripts/bench_gpu_step.py --device sim --shape tiny --steps 2 --json   # the dry run's
    python scripts/bench_gpu_step.py --device cuda --shape 8b --blocks 4 --seq max --batch 1 --steps 1 --json

``--seq max`` trains at the longest context the plan finds for the shape under the cap, with the
activation policy that gets there (``outcore plan``'s longest context, ``--seq-len max``), and
reports the plan's estimate beside the GPU peak: the long-context stage of ``gpu_proof.sh``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from bench_big import SHAPES, _init

from outcore.cli.jsonout import emit_json, json_stdout

# the proof's shapes by short name; "tiny" is the dry run's (seconds on the simulated device)
SHAPE_NAMES = {"1.7b": "smollm2-1.7b", "8b": "llama3-8b"}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "sim", "cpu"))
    ap.add_argument("--shape", default="1.7b", choices=(*SHAPE_NAMES, "tiny"))
    ap.add_argument("--blocks", type=int, default=None, help="decoder blocks (default: the shape's)")
    ap.add_argument("--optim", default="adamw", help="adamw | adamw8bit | ... (as outcore finetune --optim)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--precision", default="exact", help="exact | bf16-lean")
    ap.add_argument("--offload", default="cpu", choices=("cpu", "nvme"), help="where weights and state live")
    ap.add_argument("--update-on", default="device", choices=("device", "host"),
                    help="where the update runs (host: the CPU updates the state in RAM, at the rate the plan times)")
    ap.add_argument("--seq", default="1024", help="tokens per sequence, or max: the longest the plan finds")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--activations", default="recompute",
                    help="keep | recompute | offload | recompute_host | recompute_nvme (--seq max: the plan's)")
    ap.add_argument("--seq-tile", default="0", help="tokens per MLP tile (auto | 0 | N), as outcore's seq_tile")
    ap.add_argument("--device-mem", default="24GiB", help="the GPU's cap (a consumer card) and DEVICE budget")
    ap.add_argument("--swap-dir", default=None, help="parent of the swap directory (default: tmp)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms (the race check compares losses bit for bit)")
    ap.add_argument("--no-measure", action="store_true", help="skip the disk/copy/matmul measurements")
    ap.add_argument("--dry-run", action="store_true",
                    help="the tiny shape, short sequences, two steps, nothing measured (gpu_proof.sh --dry-run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.longest = args.seq == "max"
    if not args.longest:
        args.seq = int(args.seq)
    if args.dry_run:  # (--seq max: planned for the tiny shape, then run at 64 tokens at most)
        args.shape, args.steps, args.no_measure = "tiny", min(args.steps, 2), True
        if not args.longest:
            args.seq = min(args.seq, 64)

    with json_stdout(args.json):  # library chatter to stderr: stdout is the one JSON document
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import torch

    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    swap = tempfile.mkdtemp(prefix="bench_gpu_step_", dir=args.swap_dir)
    try:
        run, out = _setup(args, swap)
        try:
            out.update(_train(run, args))
            out["weights_digest"] = _digest(run["engine"])
        except torch.OutOfMemoryError as err:  # over the cap: the plan's estimate was short
            out.update(status="failed", reason=f"out of memory at {args.seq} tokens under the "
                                               f"{args.device_mem} cap: {str(err).splitlines()[0]}")
        finally:
            run["engine"].close()
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if out.get("status") == "failed":
        if args.json:
            emit_json(json.dumps(out, indent=1))
        else:
            print(out["reason"], file=sys.stderr)
        return 1
    out["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["floor"] = _floor(out, run, args)
    # a long-context run holds if it also stayed under the cap the plan planned for
    out["within_cap"] = (out["gpu_peak_reserved_bytes"] <= out["device_cap_bytes"]
                         if "gpu_peak_reserved_bytes" in out else None)
    out["status"] = "passed" if all(math.isfinite(x) for x in out["losses"]) and out["within_cap"] is not False \
        else "failed"
    if args.json:
        emit_json(json.dumps(out, indent=1))
        return 0
    print(f"{out['shape']} x{out['layers']} on {out['device']}: {out['median_step_s']:.2f} s/step "
          f"(plan {out['plan']['step_s']:.2f}, floor {out['floor']['step_s']:.2f}), "
          f"{out['tokens_per_s']:.0f} tokens/s, {out['model_tflops']:.1f} TFLOPS, stall {out['stall_pct']:.1f}%")
    return 0


def _setup(args: argparse.Namespace, swap: str) -> tuple[dict, dict]:
    """The meta model, its plan and the engine on the device; (the run's objects, the result so far)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outcore.activations import apply_activation_policy
    from outcore.bytesize import parse_bytes
    from outcore.kernels import CausalLMHeadLoss
    from outcore.models._lazy import materialize_buffers
    from outcore.offload.device import resolve_device
    from outcore.offload.store import probe_hardware
    from outcore.planner import budgets_from_probe, plan_for_config
    from outcore.training.build import offload_from_plan, optimizer_for_config
    from outcore.training.config import load_config

    device = resolve_device(args.device)
    cap = parse_bytes(args.device_mem)
    if device.type == "cuda":  # a consumer card: the allocator refuses more than this
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        torch.cuda.reset_peak_memory_stats(device)
    shape = TINY if args.shape == "tiny" else SHAPES[SHAPE_NAMES[args.shape]]
    hf = LlamaConfig(**{**shape, "num_hidden_layers": args.blocks or shape["num_hidden_layers"]}, use_cache=False)

    def config(seq: int, activations: str):
        return load_config(overrides=[f"{k}={v}" for k, v in dict(
            method="full", optim=args.optim, dtype=args.dtype, precision=args.precision, seq_len=seq,
            batch_size=args.batch, activations=activations, offload=args.offload, device=device.type,
            update_on=args.update_on,
            max_grad_norm=0.0, grad_accum=1, lr=1e-5, weight_decay=0.0, device_mem=args.device_mem,
            seq_tile=args.seq_tile, swap_dir=os.path.join(swap, "swap"), output=os.path.join(swap, "out")).items()])

    with torch.device("meta"):
        model = LlamaForCausalLM(hf).to(getattr(torch, args.dtype))
    materialize_buffers(model, hf)
    n_params = sum(p.numel() for p in model.parameters())
    probe = probe_hardware(swap, measure=not args.no_measure)
    budgets = dataclasses.replace(budgets_from_probe(probe, device_mem=args.device_mem), host_bytes=1 << 40,
                                  ram_bytes=1 << 40)
    longest = None
    if args.longest:  # every policy weighed, as `outcore plan --seq-len max` weighs them
        longest = _longest(config(1024, "auto"), model, budgets)
        args.seq = min(longest.seq_len, 64) if args.dry_run else longest.seq_len
        args.activations = longest.activations
    cfg = config(args.seq, args.activations)
    plan = plan_for_config(cfg, model, budgets=budgets)
    head = CausalLMHeadLoss(model.lm_head)
    opt = optimizer_for_config(cfg, [p for p in model.parameters() if p.requires_grad], streaming=True)
    t0 = time.perf_counter()
    engine = offload_from_plan(cfg, model, opt, plan, Path(cfg.output), head_loss=head, fill=_init, device=device)
    setup_s = time.perf_counter() - t0
    # checkpoints or activations on NVMe go to the engine's swap disk where it has one (as a run's do)
    to_disk = args.activations in ("offload", "recompute_nvme") and engine.store.has_tier("nvme")
    host = plan.tier_bytes["HOST"].get("activations", 0)  # block checkpoints on HOST: the plan's bytes
    apply_activation_policy(model, args.activations, store=engine.store if to_disk else None,
                            prefetch_depth=plan.activations_read_ahead, seq_tile=args.seq_tile,
                            host_budget=max(host, 1 << 30))  # (read ahead as deep as the plan counts)
    t = plan.time
    out = {"device": str(device), "device_name": _device_name(device), "shape": args.shape,
           "layers": hf.num_hidden_layers, "params": n_params, "optim": args.optim, "dtype": args.dtype,
           "precision": args.precision, "offload": args.offload, "update_on": args.update_on,
           "seq_len": args.seq, "batch_size": args.batch,
           "activations": args.activations, "seq_tile": args.seq_tile, "device_mem": args.device_mem,
           "device_cap_bytes": cap, "prefetch": plan.prefetch_depth,
           # --seq max: the plan's longest context (run at 64 tokens at most in a dry run)
           "longest": None if longest is None else longest.to_dict(),
           "setup_s": setup_s, "deterministic": args.deterministic,
           "plan": {"step_s": t.step_s, "compute_s": t.compute_s, "update_s": t.update_s, "io_bytes": t.io_bytes,
                    "io_s": t.io_s, "tier_bytes": plan.tier_bytes, "notes": plan.notes},
           "measured_rates": {"disk_read_gbps": budgets.disk_read_gbps, "disk_write_gbps": budgets.disk_write_gbps,
                              "h2d_gbps": budgets.h2d_gbps, "d2h_gbps": budgets.d2h_gbps,
                              "measured": budgets.measured}}
    return {"engine": engine, "model": model, "head": head, "vocab": hf.vocab_size, "device": device}, out


def _longest(cfg, model, budgets):
    """The plan's longest context for ``cfg``'s model and budgets (``cli/plan.py:take_longest``)."""
    from outcore.errors import BudgetError
    from outcore.planner import plan_for_config

    try:
        longest = plan_for_config(cfg, model, budgets=budgets).longest
    except BudgetError:  # 1024 tokens do not fit: the search still runs from one token
        longest = plan_for_config(dataclasses.replace(cfg, seq_len=1), model, budgets=budgets).longest
    if longest is None:
        raise SystemExit(f"--seq max: not even one token of batch {cfg.batch_size} fits {cfg.device_mem}")
    return longest


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _train(run: dict, args: argparse.Namespace) -> dict:
    """One warm-up step and ``args.steps`` timed ones: times, stalls, link bytes and losses."""
    import torch

    from outcore.offload.device import synchronize_device
    from outcore.offload.store import Tier

    model, head, engine, device = run["model"], run["head"], run["engine"], run["device"]
    traffic = engine.store.traffic

    def loss_fn(m, ids):
        return head(model.model(input_ids=ids).last_hidden_state, ids)

    def links() -> dict[str, int]:
        (d_read, d_written), (n_read, n_written) = traffic.totals(Tier.DEVICE), traffic.totals(Tier.NVME)
        return {"h2d": d_written, "d2h": d_read, "nvme_read": n_read, "nvme_write": n_written}

    g = torch.Generator().manual_seed(0)
    times, stalls, moved, losses = [], [], [], []
    for step in range(args.steps + 1):
        ids = torch.randint(0, run["vocab"], (args.batch, args.seq), generator=g).to(device)
        before, stall0 = links(), engine.stall_s
        synchronize_device(device)
        t = time.perf_counter()
        loss = engine.train_step(loss_fn, [ids], 1e-5)
        engine.mem.flush()  # the step's write-backs are part of it
        synchronize_device(device)
        dt = time.perf_counter() - t
        losses.append(float(loss))  # host sync (JSON keeps a float's every bit)
        after = links()
        if step > 0:  # the first step is the warm-up
            times.append(dt)
            stalls.append(engine.stall_s - stall0)
            moved.append({k: after[k] - before[k] for k in after})
        if not args.json:
            print(f"step {step}: {dt:.2f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    n = sum(s.numel for u in engine.units for s in u.slots)
    out = {"step_s": times, "median_step_s": step_s, "tokens_per_s": tokens / step_s,
           # 6 N T: forward + backward of every weight (the recompute's extra forward not counted)
           "model_tflops": 6 * n * tokens / step_s / 1e12,
           "stall_pct": 100 * statistics.median(stalls) / step_s,
           "link_bytes_per_step": {k: int(statistics.median(m[k] for m in moved)) for k in moved[0]},
           "losses": losses}
    if device.type == "cuda":
        out["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["gpu_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return out


def _digest(engine) -> str:
    """sha256 of every unit's trained weights (the race check compares runs by it)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for i in range(len(engine.units)):
        h.update(engine.mem.weights(i).view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _floor(out: dict, run: dict, args: argparse.Namespace) -> dict:
    """The step's physical floor: the slowest of compute at the measured matmul rate and each
    link's bytes (as counted this step) at its measured rate."""
    from outcore.planner.budget import measure_matmul_flops

    rates = out["measured_rates"]
    flops = 0.0 if args.no_measure else measure_matmul_flops(run["device"].type if run["device"].type != "sim"
                                                             else "cpu", dtype=args.dtype)
    tokens = args.batch * args.seq
    b = out["link_bytes_per_step"]
    parts = {"compute_s": 6 * out["params"] * tokens / flops if flops else 0.0,
             "disk_s": (b["nvme_read"] / rates["disk_read_gbps"] + b["nvme_write"] / rates["disk_write_gbps"]) / 1e9,
             "copy_s": (b["h2d"] / rates["h2d_gbps"] + b["d2h"] / rates["d2h_gbps"]) / 1e9,
             "matmul_tflops": flops / 1e12}
    parts["step_s"] = max(parts["compute_s"], parts["disk_s"], parts["copy_s"])
    parts["ratio"] = out["median_step_s"] / parts["step_s"] if parts["step_s"] else None
    return parts


if __name__ == "__main__":
    raise SystemExit(main())
