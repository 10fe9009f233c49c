"""Optimizer update throughput and state size, side by side in one run, per CPU ISA level.

For a model-shaped set of fp32 tensors (a Llama-like stack, ~50M parameters; ``--quick``:
~5M), every optimizer updates the *same* parameter and gradient tensors (updates are
in place; values drift, which does not change the cost), interleaved round by round so
that load on a shared machine hits all of them alike. Reported per optimizer:

* ``params_per_s``: parameters / median step time (after warm-up; min and max printed),
* ``vs_fused``: that over torch's fused fp32 AdamW's, measured in the same rounds,
* ``state_bytes_per_param``: bytes of optimizer state / parameters,
* ``cpu_s_median``: process CPU seconds per step (all threads). On a shared, overloaded
  machine wall time mostly measures the neighbours; CPU time is the steadier figure.

Every figure comes with the machine's CPU model and the ISA level it ran at (``_meta``):
the outcore kernel's (``kernels/cpu_ext.py: cpu_isa``) and torch's own
(``torch.backends.cpu.get_cpu_capability``), and ``isa_forced`` where that level is below
the CPU's best (AVX2 measured on an AVX-512 machine is not an AVX2-only machine's figure).
``--isa AVX2,AVX512`` runs each level in its own process with ``OUTCORE_CPU_ISA`` and
``ATEN_CPU_CAPABILITY`` set to it (torch's fused AdamW and the low-rank optimizers' matmuls
then use that level's kernels too: what an AVX2-only CPU runs), ``--repeat N`` alternates the
levels N times; the summary gives each optimizer's median and range of ``vs_fused`` over the
runs.

Optimizers: torch's fused AdamW, bitsandbytes' AdamW8bit (where installed), outcore's
AdamW8bit as constructed by default (``adamw8bit``: FP8 codes) and in its other state format
(``adamw8bit_dynamic``: bitsandbytes' dynamic maps), their ``bf16-lean`` forms (``lean_adamw8bit``,
``lean_adamw8bit_dynamic``: bf16 weights,
stochastic rounding; ``optim/lean.py``), GaLore, APOLLO, APOLLO-Mini and FRUGAL. Low-rank optimizers
project every matrix, embedding included; vectors (norms) get Adam. Their SVD / subspace
refreshes happen at step 0 only (``update_proj_gap`` 200), so the figures are their steady
state.

    python scripts/bench_optim.py [--quick] [--json] [--steps N] [--impls] [--only a,b]
                                  [--isa AVX2,AVX512] [--repeat N] [--threads N]

``--impls`` adds ``adamw8bit_ref`` (pure PyTorch) and ``adamw8bit_compile``
(``torch.compile`` of it) next to the C++ kernel (``adamw8bit``). Threads:
``torch.set_num_threads(os.cpu_count())`` for every mode, or ``--threads N`` (1: the cost per
core, what a machine with more cores multiplies).

Reading the ratio on a shared 2-core box: the fused fp32 update opens one parallel region
per tensor, and with a neighbour's job on a core its threads wait on OpenMP barriers (0.5 s
steps seen, and their spinning counts as CPU time); the 8-bit update has one region per
step. On a quiet machine both are bound by the cores (measured 2026-11-22: 12 ms per step
for the 50M set), loaded the fused update loses more. Report the median of several runs
and the load (``_meta.loadavg``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from outcore.cli.jsonout import emit_json, json_stdout

# torch's ATEN_CPU_CAPABILITY for each outcore ISA level (its dispatch has no VBMI level)
ATEN_CAPABILITY = {"DEFAULT": "default", "AVX2": "avx2", "AVX512": "avx512", "AVX512_VBMI": "avx512"}
FUSED = "torch_adamw_fused"


def model_shaped(quick: bool, seed: int = 0) -> list[torch.nn.Parameter]:
    """fp32 tensors shaped like a small Llama: embedding, per layer q/k/v/o, MLP, norms."""
    hidden, inter, layers, vocab = (256, 688, 4, 4000) if quick else (640, 1728, 8, 16000)
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)]
        shapes += [(hidden,), (hidden,)]
    shapes += [(hidden,)]
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def _groups(params):
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() != 2]
    return mats, vecs


def _bf16(params):
    out = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
    for q, p in zip(out, params):
        q.grad = p.grad.bfloat16()
    return out


def build(name: str, params):
    """The optimizer ``name`` over ``params`` (same lr / betas / eps / weight decay for all).

    Ranks: GaLore 128 and APOLLO 256 (their papers' settings for ~1B models: 1/4-1/8 of
    the hidden size) on the full set; scaled to the hidden size in the quick set.
    """
    from outcore.kernels.adamw8bit import DEFAULT_STATE_FORMAT
    from outcore.optim import APOLLO, FRUGAL, AdamW8bit, APOLLOMini, GaLore
    from outcore.optim.lean import LeanOptimizer

    kw = dict(lr=1e-4, weight_decay=0.0)
    mats, vecs = _groups(params)
    hidden = params[0].shape[1]
    if name == FUSED:
        return torch.optim.AdamW(params, fused=True, **kw)
    if name == "bnb_adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, **kw)
    fmt = "dynamic" if name.endswith("_dynamic") else DEFAULT_STATE_FORMAT
    if name.startswith("lean_adamw8bit"):  # bf16 copies of the tensors (their own memory)
        return LeanOptimizer(AdamW8bit(_bf16(params), state_format=fmt, **kw), seed=0)
    if name.startswith("adamw8bit"):
        impl = "ref" if name.endswith("_ref") else "compile" if name.endswith("_compile") else "auto"
        return AdamW8bit(params, impl=impl, state_format=fmt, **kw)
    if name == "galore":
        return GaLore([{"params": vecs, "rank": None}, {"params": mats}], rank=min(128, hidden // 5), **kw)
    if name == "apollo":
        return APOLLO([{"params": vecs, "rank": None}, {"params": mats}], rank=min(256, hidden // 2), **kw)
    if name == "apollo_mini":
        return APOLLOMini([{"params": vecs, "rank": None}, {"params": mats}], **kw)
    if name == "frugal":
        return FRUGAL([{"params": vecs, "density": None}, {"params": mats}], density=0.25, **kw)
    raise ValueError(f"unknown optimizer {name!r}")


def state_bytes(opt) -> int:
    """Bytes of every tensor in the optimizer's state (shared map tensors excluded)."""
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k not in ("qmap1", "qmap2"):
                total += v.numel() * v.element_size()
    return total


def cpu_best_isa() -> str:
    """The highest outcore ISA level this CPU's flags (``/proc/cpuinfo``) allow, whatever
    ``ATEN_CPU_CAPABILITY`` says (Linux; elsewhere torch's capability)."""
    from outcore.kernels.cpu_ext import _cpu_flags, supported_isa_levels

    flags = _cpu_flags()
    if not flags:
        return supported_isa_levels()[-1]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512_VBMI" if "avx512vbmi" in flags else "AVX512"
    return "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT"


def machine() -> dict:
    """The CPU model, the ISA levels in use (outcore's kernel, torch's dispatch) and the load."""
    from outcore.kernels.cpu_ext import cpu_extension, cpu_isa, supported_isa_levels

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    # isa_forced: a level below what the CPU's flags allow (OUTCORE_CPU_ISA / --isa; torch's own
    # capability is forced along with it, so it cannot tell): say so with the figure
    return {"cpu_model": model, "cores": os.cpu_count(), "isa": cpu_isa(),
            "isa_supported": list(supported_isa_levels()), "isa_cpu_best": cpu_best_isa(),
            "isa_forced": cpu_isa() != cpu_best_isa(),
            "kernel": "cpp" if cpu_extension() is not None else "reference",
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "loadavg": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d")}


def run_once(names: list[str], quick: bool, steps: int, warmup: int, threads: int) -> dict:
    """One process, one ISA level: every optimizer, interleaved round by round."""
    torch.set_num_threads(threads)
    params = model_shaped(quick)
    n_params = sum(p.numel() for p in params)
    opts, times, cpu = {}, {}, {}
    for name in names:
        try:
            opts[name] = build(name, params)
        except ImportError as exc:  # bitsandbytes absent
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        for _ in range(warmup):  # allocation, JIT builds, the first SVD
            opts[name].step()
        times[name], cpu[name] = [], []
    for _ in range(steps):  # interleaved: each round times every optimizer once
        for name, opt in opts.items():
            c0, t0 = time.process_time(), time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    result = {}
    for name, opt in opts.items():
        med = statistics.median(times[name])
        result[name] = {"params_per_s": n_params / med,
                        "state_bytes_per_param": state_bytes(opt) / n_params,
                        "step_s_median": med, "step_s_min": min(times[name]),
                        "step_s_max": max(times[name]),
                        "cpu_s_median": statistics.median(cpu[name])}
    base = result.get(FUSED, {}).get("params_per_s")
    for r in result.values():
        r["vs_fused"] = r["params_per_s"] / base if base else None
    return {**result, "_meta": {**machine(), "n_params": n_params, "steps": steps}}


def run_levels(levels: list[str], repeat: int, child_args: list[str]) -> dict:
    """Each level in its own process (the ISA is fixed when torch loads), alternated ``repeat``
    times; per level its runs and a summary (median and range of each optimizer's ratio)."""
    runs: dict[str, list[dict]] = {lv: [] for lv in levels}
    for _ in range(repeat):
        for lv in levels:
            env = {**os.environ, "OUTCORE_CPU_ISA": lv, "ATEN_CPU_CAPABILITY": ATEN_CAPABILITY[lv]}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *child_args, "--json"],
                                 env=env, stdout=subprocess.PIPE, check=True, text=True)
            runs[lv].append(json.loads(out.stdout))
    result = {}
    for lv, rs in runs.items():
        summary = {}
        for name in (k for k in rs[0] if k != "_meta"):
            ratios = [r[name]["vs_fused"] for r in rs if r.get(name, {}).get("vs_fused") is not None]
            summary[name] = {"params_per_s_median": statistics.median(r[name]["params_per_s"] for r in rs),
                             "vs_fused_median": statistics.median(ratios) if ratios else None,
                             "vs_fused_min": min(ratios, default=None), "vs_fused_max": max(ratios, default=None),
                             "state_bytes_per_param": rs[0][name]["state_bytes_per_param"]}
        result[lv] = {"summary": summary, "runs": rs, "_meta": rs[0]["_meta"]}
    return result


def _print_run(result: dict) -> None:
    meta = result["_meta"]
    forced = " (forced)" if meta["isa_forced"] else ""
    print(f"{meta['n_params'] / 1e6:.1f}M parameters, {meta['threads']} threads, {meta['steps']} timed steps; "
          f"{meta['cpu_model']}, outcore ISA {meta['isa']}{forced}, torch {meta['torch_cpu_capability']}, "
          f"load {meta['loadavg'][0]:.1f}")
    base_cpu = result.get(FUSED, {}).get("cpu_s_median")
    print(f"{'optimizer':<20}{'G params/s':>11}{'vs fused':>9}{'state B/param':>15}"
          f"{'step s (min..max)':>24}{'cpu s':>8}{'vs fused':>9}")
    for name, r in result.items():
        if name == "_meta":
            continue
        rel = f"{r['vs_fused']:.2f}x" if r["vs_fused"] else "-"
        rel_cpu = f"{base_cpu / r['cpu_s_median']:.2f}x" if base_cpu and r["cpu_s_median"] else "-"
        print(f"{name:<20}{r['params_per_s'] / 1e9:>11.3f}{rel:>9}{r['state_bytes_per_param']:>15.3f}"
              f"{r['step_s_median']:>10.3f} ({r['step_s_min']:.3f}..{r['step_s_max']:.3f})"
              f"{r['cpu_s_median']:>8.3f}{rel_cpu:>9}")


def _print_levels(result: dict) -> None:
    for lv, res in result.items():
        meta = res["_meta"]
        forced = ", forced" if meta["isa_forced"] else ""
        print(f"== ISA {lv} (torch {meta['torch_cpu_capability']}{forced}), {meta['cpu_model']}, "
              f"{len(res['runs'])} runs; vs fused AdamW: median (min..max)")
        for name, s in res["summary"].items():
            ratio = (f"{s['vs_fused_median']:.2f}x ({s['vs_fused_min']:.2f}..{s['vs_fused_max']:.2f})"
                     if s["vs_fused_median"] is not None else "-")
            print(f"  {name:<20}{s['params_per_s_median'] / 1e9:>8.3f} G params/s  {ratio}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~5M parameters, 3 timed steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per optimizer")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer")
    ap.add_argument("--impls", action="store_true",
                    help="also time the pure-PyTorch and torch.compile 8-bit updates")
    ap.add_argument("--only", default="", help="comma-separated subset of optimizer names")
    ap.add_argument("--isa", default="", help="comma-separated ISA levels (DEFAULT, AVX2, AVX512, "
                    "AVX512_VBMI), each run in its own process; default: this process's level")
    ap.add_argument("--repeat", type=int, default=1, help="runs per ISA level (alternated; with --isa)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads for every optimizer (default: all cores; 1: the cost per core)")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 7)
    names = [FUSED, "bnb_adamw8bit", "adamw8bit", "adamw8bit_dynamic", "lean_adamw8bit", "lean_adamw8bit_dynamic",
             "galore", "apollo", "apollo_mini", "frugal"]
    if args.impls:
        names += ["adamw8bit_ref", "adamw8bit_compile"]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]

    if args.isa:
        from outcore.kernels.cpu_ext import supported_isa_levels
        levels = [lv.strip().upper() for lv in args.isa.split(",") if lv.strip()]
        bad = [lv for lv in levels if lv not in supported_isa_levels()]
        if bad:
            ap.error(f"--isa {','.join(bad)}: this CPU runs {', '.join(supported_isa_levels())}")
        child = ["--steps", str(steps), "--warmup", str(args.warmup), "--only", ",".join(names),
                 "--threads", str(args.threads)]
        result = run_levels(levels, args.repeat, child + (["--quick"] if args.quick else []))
        if args.json:
            emit_json(json.dumps(result, indent=1))
        else:
            _print_levels(result)
        return 0
    result = run_once(names, args.quick, steps, args.warmup, args.threads)
    if args.json:
        emit_json(json.dumps(result, indent=1))
    else:
        _print_run(result)
    return 0


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        sys.exit(main())
