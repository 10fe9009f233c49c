"""Sharded out-of-core data parallelism: what one rank holds at 1 rank and at N ranks.

Runs the same full fine-tune out of core (weights and optimizer state on NVMe or in RAM, a Llama
shape whose optimizer state dominates) once on 1 rank and once on ``--world`` ranks launched
by ``torchrun`` (gloo on CPU, NCCL on GPUs), each rank in its own process with its own swap
directory, one micro-batch per rank. Each rank reports:

* ``state_bytes``: bytes of optimizer state it keeps (its handles, on NVMe or in RAM as
  ``--offload`` says: ~1/N of the whole at N ranks), ``nvme_held_bytes``, everything its swap
  file holds (weights too: every rank keeps the whole weights), and its arenas'
  budgets (``host_arena_bytes``: the state streaming through, plus all of it with
  ``--offload cpu``; ``device_arena_bytes``: the weights' window);
* ``peak_rss_bytes`` (VmHWM, the whole process, setup included) and ``steps_peak_rss_bytes``
  (VmHWM reset after setup: the steps alone);
* ``median_step_s`` over the timed steps (after one warm-up).

The model is built on the meta device and initialized unit by unit into the store, so it is
never whole in RAM. On a machine with few cores the N ranks share them: step times at N ranks
are then not a speed-up measurement.

    python scripts/bench_dist.py --json                  # 1 rank vs 2 ranks
    python scripts/bench_dist.py --layers 2 --hidden 512 # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from outcore.cli.jsonout import emit_json, json_stdout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _measure import reset_peak_rss
from _rss_trace import status_bytes


def _rank(args: argparse.Namespace) -> dict:
    """One rank's run (in a process torchrun started, or alone for 1 rank)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outcore.models import plain_name
    from outcore.models._lazy import materialize_buffers
    from outcore.offload.distributed import ranks as ranks_mod
    from outcore.offload.engine import WEIGHTS, offload_model
    from outcore.offload.store import Tier
    from outcore.optim import build_optimizer

    ranks = ranks_mod.join(timeout_s=600)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks.world))
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, tie_word_embeddings=True, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    materialize_buffers(model, cfg)
    n_params = sum(p.numel() for p in model.parameters())

    def init(slot, out):  # seeded per parameter: the same model on every rank and every run
        g = torch.Generator().manual_seed(zlib.crc32(plain_name(slot.name).encode()))
        out.normal_(0.0, 0.02, generator=g) if out.dim() >= 2 else out.fill_(1.0)

    opt = build_optimizer(args.optim, list(model.parameters()), lr=1e-5, weight_decay=0.0)
    swap = Path(args.out) / f"swap_w{ranks.world}_r{ranks.rank}"
    t0 = time.perf_counter()
    eng = offload_model(model, opt, offload=args.offload, swap_dir=swap, prefetch=1, init_weights=init, ranks=ranks)
    setup_s = time.perf_counter() - t0
    state = sum(h.numel * h.dtype.itemsize for u in eng.units for p, h in u.layout.handles.items() if p.kind != WEIGHTS)
    reset_peak_rss()
    g = torch.Generator().manual_seed(1000 + ranks.rank)  # each rank its own micro-batch

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids).loss

    times, losses = [], []
    for step in range(args.steps + 1):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        t = time.perf_counter()
        losses.append(float(eng.train_step(loss_fn, [ids], 1e-5)))
        if step > 0:  # the first step is the warm-up
            times.append(time.perf_counter() - t)
    held = eng.tier_stats()["NVME"].held_bytes
    eng_host, eng_device = eng.store.budget(Tier.HOST), eng.store.budget(Tier.DEVICE)
    steps_peak = status_bytes("VmHWM")["VmHWM"]
    eng.close()
    ranks_mod.leave()
    return {"rank": ranks.rank, "world": ranks.world, "params": n_params, "state_bytes": state,
            "host_arena_bytes": eng_host, "device_arena_bytes": eng_device,
            "nvme_held_bytes": held, "steps_peak_rss_bytes": steps_peak,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "setup_s": setup_s, "median_step_s": statistics.median(times), "losses": losses,
            "threads": torch.get_num_threads()}


def _launch(world: int, args: argparse.Namespace, out: Path) -> list[dict]:
    """Run ``world`` ranks (torchrun for more than one) and collect each rank's JSON."""
    own = [sys.executable, __file__, "--child", "--out", str(out), "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--seq", str(args.seq),
           "--batch", str(args.batch), "--steps", str(args.steps), "--optim", args.optim, "--offload", args.offload]
    cmd = own if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={world}", *own[1:]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
    return [json.loads((out / f"rank{r}_of{world}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks of the sharded run (compared with 1)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (intermediate 4x, 64-wide heads)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    ap.add_argument("--optim", default="adamw", help="adamw | adamw8bit (element-wise optimizers shard)")
    ap.add_argument("--offload", default="nvme", choices=("nvme", "cpu"),
                    help="where weights and state live: nvme (swap files) or cpu (RAM)")
    ap.add_argument("--swap-dir", default=None, help="parent of the swap directories (default: tmp)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        res = _rank(args)
        (Path(args.out) / f"rank{res['rank']}_of{res['world']}.json").write_text(json.dumps(res))
        return 0
    out = Path(tempfile.mkdtemp(prefix="bench_dist_", dir=args.swap_dir))
    try:
        runs = {str(w): _launch(w, args, out) for w in (1, args.world)}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    one, many = runs["1"][0], runs[str(args.world)]
    summary = {
        "cpu_count": os.cpu_count(), "params": one["params"], "optim": args.optim, "runs": runs,
        "offload": args.offload, "state_ratio": max(r["state_bytes"] for r in many) / one["state_bytes"],
        "host_arena_ratio": max(r["host_arena_bytes"] for r in many) / one["host_arena_bytes"],
        "peak_rss_ratio": max(r["peak_rss_bytes"] for r in many) / one["peak_rss_bytes"],
        "steps_peak_rss_ratio": max(r["steps_peak_rss_bytes"] for r in many) / one["steps_peak_rss_bytes"],
    }
    if args.json:
        emit_json(json.dumps(summary, indent=1))
    else:
        for w, rs in runs.items():
            for r in rs:
                print(f"world {w} rank {r['rank']}: state {r['state_bytes'] / 2**30:.3f} GiB, "
                      f"HOST arena {r['host_arena_bytes'] / 2**30:.3f} GiB, "
                      f"NVMe held {r['nvme_held_bytes'] / 2**30:.3f} GiB, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} "
                      f"GiB (steps {r['steps_peak_rss_bytes'] / 2**30:.2f}), {r['median_step_s']:.2f} s/step")
    return 0


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        raise SystemExit(main())
