#!/usr/bin/env python3
"""Peak RSS against sequence length: in-memory training with Hugging Face gradient checkpointing
beside outcore out of core, on the default model (SmolLM2-135M), one micro-batch of one sequence.

Each (mode, length) runs in its own process, one after the other (a peak of one must not hide
another's, BENCHMARKING.md); the peak is the process's RSS high-water mark (``ru_maxrss``) over
loading the model and ``--steps`` optimizer steps, what an RSS cap (``--cap``) would stop (glibc's
mmap threshold fixed at 128 KiB in every child, as ``bench_memory.py`` does, so freed tensors
leave the RSS):

- ``hf_gc``: the whole fp32 model in RAM, ``gradient_checkpointing_enable()`` (non-reentrant,
  transformers' default), the model's own loss (full ``[tokens, vocab]`` logits), torch's
  fused AdamW: the usual in-memory recipe for long context.
- ``outcore_recompute``: out of core (``offload=nvme``: weights and AdamW state on the swap
  disk), every block recomputed, its checkpoint (input hidden state) kept in RAM, the MLP
  tiled (``seq_tile=auto``, or ``--seq-tile``), the chunked head loss.
- ``outcore_recompute_nvme``: the same with the block checkpoints on NVMe too.

Per mode, the least-squares slope of peak RSS per 1K tokens over the lengths that ran, beside
``hidden x bytes x blocks x 1K`` (what keeping every block checkpoint in RAM costs per 1K
tokens); the first length over ``--cap``; and per length where both ran, each outcore mode's
last step time over ``hf_gc``'s (the 1.15x bound of issue 29).

``--plan-longest`` checks the plan's longest context instead (issue 29: within 10% of the longest
that really ran): per outcore mode, the longest length whose plan (the trainer's own) expects a
peak RSS within ``--cap``, bisected with the mode's activation policy held; then runs from that
length up, ``--plan-step`` of it at a time, until one goes over the cap (at most ``--plan-runs``).

Bounded: a run whose RSS passes ``--kill-over`` (default: the cap) is stopped and counted over
the cap, a mode that stopped is not run at longer lengths, one run takes at most ``--timeout``
and all of them ``--budget-s`` (what is left unrun says so); ``--out FILE`` is rewritten after
every run, so an interrupted measurement keeps what finished.

Usage::

    python scripts/bench_long_context.py --json                       # 1K to 32K, every mode
    python scripts/bench_long_context.py --json --budget-s 7200 --out runs/long_context.json
    python scripts/bench_long_context.py --json --lengths 256,512     # a busy machine: short ones
    python scripts/bench_long_context.py --json --modes outcore_recompute_nvme --lengths 16384,32768
    python scripts/bench_long_context.py --json --modes outcore_recompute --plan-longest --cap 2GiB
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("hf_gc", "outcore_recompute", "outcore_recompute_nvme")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
GiB = 1 << 30


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _ids(seq: int):
    import torch

    return torch.randint(3, 49152, (1, seq), generator=torch.Generator().manual_seed(seq))


HYPER = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _policy(mode: str) -> str:
    return "recompute_nvme" if mode.endswith("_nvme") else "recompute"


def _child(mode: str, seq: int, steps: int, work_dir: str, seq_tile: str) -> dict:
    """One mode at one length in this process: ``steps`` optimizer steps; peak RSS and step times."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
    from _bench_outcore import OutcoreTrainer, full_model

    torch.manual_seed(0)
    times, out = [], {"mode": mode, "seq_len": seq}
    if mode == "hf_gc":
        model = full_model("default", None, 0)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()  # transformers' default: non-reentrant torch.utils.checkpoint per block
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        out["rss_loaded_bytes"] = _peak_rss()
        for _ in range(steps):
            t0 = time.perf_counter()
            ids = _ids(seq)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    else:
        trainer = OutcoreTrainer("default", None, 0, offload="nvme", optim="adamw", seq_len=seq, batch_size=1,
                                 hyper=HYPER, work_dir=work_dir, activations=_policy(mode), seq_tile=seq_tile)
        try:
            out["rss_loaded_bytes"] = _peak_rss()
            out["plan"] = {"activations": trainer.plan.activations, "seq_tile": trainer.plan.seq_tile,
                           "blocks_tiled": trainer.plan.blocks_tiled,
                           "expected_peak_rss_bytes": trainer.plan.expected_peak_rss_bytes}
            for _ in range(steps):
                t0 = time.perf_counter()
                trainer.step(_ids(seq))
                times.append(time.perf_counter() - t0)
            out["tiers"] = trainer.tier_stats()
        finally:
            trainer.close()
    out.update(status="ok", peak_rss_bytes=_peak_rss(), step_s=times)
    return out


def _plan_longest(mode: str, cap: int, work_dir: str, seq_tile: str) -> dict:
    """The longest length (a multiple of ``ROUND``) whose plan for ``mode`` expects a peak RSS
    within ``cap``: the trainer's own plan (``plan_this_run``: RAM tiers + the runtime
    allowance), bisected over the length with ``mode``'s activation policy held."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _bench_outcore import lazy_model, run_config

    from outcore.errors import BudgetError
    from outcore.planner.longest import ROUND
    from outcore.training.build import plan_this_run

    model, _ = lazy_model("default", None, 0)
    peaks: dict[int, int] = {}

    def peak(n: int) -> int:
        cfg = run_config(offload="nvme", optim="adamw", seq_len=n, batch_size=1, hyper=HYPER, work=Path(work_dir),
                         activations=_policy(mode), seq_tile=seq_tile)
        try:
            peaks[n] = plan_this_run(cfg, model).expected_peak_rss_bytes
        except BudgetError:  # not even this machine's budgets hold it
            peaks[n] = 1 << 62
        return peaks[n]
    lo, hi = 1, 1 << 12  # in units of ROUND tokens
    if peak(lo * ROUND) > cap:
        return {"mode": mode, "plan_longest": 0, "plan_peaks": peaks}
    while peak(hi * ROUND) <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid * ROUND) <= cap else (lo, mid)
    return {"mode": mode, "plan_longest": lo * ROUND, "plan_expected_peak_rss_bytes": peaks[lo * ROUND]}


def _slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares bytes per 1K tokens through (seq_len, peak) points (None under two lengths)."""
    if len({s for s, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(s for s, _ in points) / n, sum(p for _, p in points) / n
    sxx = sum((s - mx) ** 2 for s, _ in points)
    return 1024 * sum((s - mx) * (p - my) for s, p in points) / sxx


@functools.lru_cache(maxsize=None)  # (the summary is rewritten after every run)
def _checkpoint_bytes_per_1k() -> int:
    """hidden x bytes x blocks x 1K of the default model (fp32): every block checkpoint in RAM."""
    from outcore.cli.plan import model_config

    cfg = model_config("default")
    return int(cfg.hidden_size) * 4 * int(cfg.num_hidden_layers) * 1024


def _run_child(cmd: list[str], env: dict, timeout: float, kill_over: int) -> dict:
    """One child run: its RESULT line, or why there is none (killed over ``kill_over`` bytes of
    RSS, polled every 0.2 s; timed out; failed)."""
    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        t0, over = time.perf_counter(), 0
        while p.poll() is None:
            try:
                rss = psutil.Process(p.pid).memory_info().rss
            except psutil.Error:  # it just ended
                rss = 0
            if rss > kill_over or time.perf_counter() - t0 > timeout:
                over = rss if rss > kill_over else 0
                p.kill()
                p.wait()
                if over:
                    return {"status": f"over the cap: stopped at {over / GiB:.2f} GiB RSS", "peak_rss_bytes": over}
                return {"status": f"timed out after {timeout:.0f} s"}
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith("RESULT ")]
        if lines:
            return json.loads(lines[-1][7:])
        return {"status": f"failed (exit {p.returncode})", "error": (err.read().strip().splitlines() or [""])[-1]}


def _summary(runs: dict[str, list[dict]], lengths: list[int], cap: int, args, env: dict,
             planned: dict[str, dict]) -> dict:
    ok = {m: [(r["seq_len"], r["peak_rss_bytes"]) for r in rs if r.get("status") == "ok"] for m, rs in runs.items()}
    done = {m: {r["seq_len"]: r for r in rs if r.get("status") == "ok"} for m, rs in runs.items()}
    ratios: dict[str, dict[int, float]] = {}
    for m in (m for m in done if m != "hf_gc" and "hf_gc" in done):
        ratios[m] = {s: r["step_s"][-1] / done["hf_gc"][s]["step_s"][-1] for s, r in done[m].items()
                     if s in done["hf_gc"]}
    return {
        "model": "default (SmolLM2-135M-Instruct, fp32)", "batch_size": 1, "steps": args.steps,
        "lengths": lengths, "cap_bytes": cap, "kill_over_bytes": args.kill_over_bytes, "budget_s": args.budget_s,
        "runs": runs,
        "slope_bytes_per_1k_tokens": {m: _slope(p) for m, p in ok.items()},
        "checkpoints_in_ram_bytes_per_1k_tokens": _checkpoint_bytes_per_1k(),
        # over the cap: stopped over it, failed (the kernel's OOM killer), or finished above it
        "first_over_cap": {m: next((r["seq_len"] for r in rs if r["status"].startswith(("over the cap", "failed"))
                                    or r["status"] == "ok" and r["peak_rss_bytes"] > cap), None)
                           for m, rs in runs.items()},
        "step_time_over_hf_gc": ratios,  # the last step's time, at each length where both ran
        **({"plan_longest_under_cap": planned, "longest_ran_under_cap": {m: _longest_ran(runs[m], cap)
                                                                          for m in planned}} if planned else {}),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "malloc_mmap_threshold": env["MALLOC_MMAP_THRESHOLD_"],
    }


def _longest_ran(runs: list[dict], cap: int) -> dict:
    """The longest length that ran within ``cap``, and whether a longer one went over it (else the
    runs stopped first: a lower bound)."""
    fit = [r["seq_len"] for r in runs if r.get("status") == "ok" and r["peak_rss_bytes"] <= cap]
    over = any(r.get("status", "").startswith(("over the cap", "failed"))
               or r.get("status") == "ok" and r["peak_rss_bytes"] > cap for r in runs)
    return {"seq_len": max(fit, default=0), "next_one_over_cap": over}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="sequence lengths, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps per run (the first is timed too)")
    ap.add_argument("--cap", default="4GiB", help="the RSS cap each length is checked against")
    ap.add_argument("--kill-over", default=None, help="stop a run whose RSS passes this (default: --cap)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--budget-s", type=float, default=4 * 3600.0, help="seconds all the runs may take")
    ap.add_argument("--out", default=None, help="also write the JSON here, rewritten after every run")
    ap.add_argument("--swap-dir", default=None, help="where the outcore runs' swap files go (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--seq-tile", default="auto",
                    help="outcore's seq_tile: tokens per tile of a recomputed block and its MLP (auto | 0 | N)")
    ap.add_argument("--plan-longest", action="store_true",
                    help="per outcore mode: the plan's longest length under --cap, then runs from it up in steps "
                         "of --plan-step until one goes over the cap (--lengths unused)")
    ap.add_argument("--plan-step", type=float, default=0.05, help="step over the plan's longest, as its fraction")
    ap.add_argument("--plan-runs", type=int, default=4, help="at most this many runs per mode with --plan-longest")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "SEQ"), help=argparse.SUPPRESS)
    ap.add_argument("--plan", nargs=2, metavar=("MODE", "CAP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plan:
        print("RESULT " + json.dumps(_plan_longest(args.plan[0], int(args.plan[1]),
                                                   args.swap_dir or tempfile.gettempdir(), args.seq_tile)), flush=True)
        return 0
    if args.child:
        print("RESULT " + json.dumps(_child(args.child[0], int(args.child[1]), args.steps,
                                            args.swap_dir or tempfile.gettempdir(), args.seq_tile)), flush=True)
        return 0
    from outcore.bytesize import parse_bytes
    from outcore.planner.longest import ROUND

    cap = parse_bytes(args.cap, "--cap")
    args.kill_over_bytes = parse_bytes(args.kill_over, "--kill-over") if args.kill_over else cap
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    # every tensor over 128 KiB its own mapping, unmapped when freed: the peak is what was live,
    # not what glibc's heap kept after a free (its dynamic threshold heaps tensors up to 32 MiB)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    deadline = time.perf_counter() + args.budget_s

    def run(mode: str, seq: int) -> dict:
        left = deadline - time.perf_counter()
        if left < 1:
            res = {"mode": mode, "seq_len": seq, "status": "not run: --budget-s spent"}
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, str(seq), "--steps", str(args.steps),
                   "--seq-tile", args.seq_tile]
            cmd += ["--swap-dir", args.swap_dir] if args.swap_dir else []
            t0 = time.perf_counter()
            res = {"mode": mode, "seq_len": seq, **_run_child(cmd, env, min(args.timeout, left), args.kill_over_bytes)}
            res["wall_s"] = time.perf_counter() - t0
        runs[mode].append(res)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(_summary(runs, lengths, cap, args, env, planned), indent=2) + "\n")
        if not args.json:
            peak = res.get("peak_rss_bytes")
            print(f"{mode:<24} seq {seq:>6}: {res['status']}"
                  + (f", peak RSS {peak / GiB:.2f} GiB, step {res['step_s'][-1]:.1f} s" if "step_s" in res else ""),
                  file=sys.stderr)
        return res

    planned: dict[str, dict] = {}
    if args.plan_longest:  # per outcore mode: the plan's longest under the cap, then up from it
        lengths.clear()  # (the lengths run, as they are chosen)
        for mode in (m for m in modes if m != "hf_gc"):
            cmd = [sys.executable, os.path.abspath(__file__), "--plan", mode, str(cap), "--seq-tile", args.seq_tile]
            planned[mode] = _run_child(cmd, env, args.timeout, 1 << 62)
            n = planned[mode].get("plan_longest", 0)
            step = max(ROUND, round(n * args.plan_step / ROUND) * ROUND)
            for seq in (n + i * step for i in range(args.plan_runs) if n):
                if seq not in lengths:
                    lengths.append(seq)
                res = run(mode, seq)
                if res.get("status") != "ok" or res["peak_rss_bytes"] > cap:
                    break  # over the cap: the longest that ran is the one before
    else:
        for seq in lengths:
            for mode in modes:
                if runs[mode] and runs[mode][-1].get("status") != "ok":
                    continue  # it stopped at a shorter length: a longer one would too
                run(mode, seq)
    result = _summary(runs, lengths, cap, args, env, planned)
    if args.json:
        from outcore.cli.jsonout import emit_json

        emit_json(json.dumps(result, indent=2))
    else:
        print(json.dumps({k: result[k] for k in ("slope_bytes_per_1k_tokens", "checkpoints_in_ram_bytes_per_1k_tokens",
                                                 "first_over_cap", "step_time_over_hf_gc")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
