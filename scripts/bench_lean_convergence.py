"""``precision=bf16-lean`` vs exact fp32 AdamW: fine-tune SmolLM2-135M on Shakespeare, same everything.

Issue #14, item 3: the write-lean mode keeps no fp32 master (bf16 weights updated with
stochastic rounding, ``optim/lean.py``) and 8-bit moments; its final train and validation
loss must be within 1% of exact fp32 AdamW after 200 steps on the default model and data.

Runs (each from the same weights, the same batches in the same order, the same schedule,
clipping and hyper-parameters; the loop, loss and evaluation are
``bench_adamw8bit_convergence.py``'s):

* ``adamw_fp32`` — the model in fp32, ``torch.optim.AdamW(fused=True)`` (the reference);
* ``lean_adamw8bit`` — the model in bf16 (compute and weights), ``LeanOptimizer(AdamW8bit)``:
  exactly what ``outcore finetune precision=bf16-lean optim=adamw8bit`` steps;
* ``--with-rtn``: also ``rtn_adamw8bit``, the same but rounding to nearest (an fp32 copy of a
  chunk rounded back with ``.copy_``) — what stochastic rounding is there to fix.

They run in memory: lean in memory and out of core give the same weights bit for bit
(``tests/offload/engine/test_engine_lean.py``), so streaming would only make the figure slower.
Side by side, one process and ``--threads`` (1) thread each, as the 8-bit bench does.
Also reported per run: seconds per step, and for the lean mode the bytes its update writes
per trainable parameter per step, from the optimizer's state and the weights' dtype (the
measured out-of-core figure is ``scripts/bench_lean_bytes.py``'s).

Measured (2026-11-24, shared 2-core box under heavy load, 200 steps, seq 64, batch 2, lr 5e-5,
one thread per run, AdamW8bit's dynamic maps, its default then): fp32 AdamW final train loss
(mean of the last 20 steps) 3.8210, bf16-lean AdamW8bit 3.8227 (+0.04%); last step 3.9002 vs
3.8938 (-0.16%); validation 3.8675 vs 3.8759 (+0.22%); the lean update writes 4.033 B per
parameter per step (JSON: /work/notes/lean-convergence.json).

    python scripts/bench_lean_convergence.py [--steps 200] [--seq-len 64] [--quick] [--json OUT]

``--quick`` runs 3 steps per run (proves the script works; the figures mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_adamw8bit_convergence as base  # the shared loop, loss and evaluation


def _round_to_nearest(monkey: bool) -> None:
    """Make the lean update round to nearest instead (the ``rtn_adamw8bit`` ablation)."""
    if monkey:
        import outcore.optim.lean as lean

        lean.stochastic_round_ = lambda out, x, key, offset=0: out.copy_(x)


def build(name: str, args) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, object]:
    """(model, optimizer, train set, val set) of run ``name``."""
    from outcore.data import build_datasets
    from outcore.models import load_model
    from outcore.optim import AdamW8bit, LeanOptimizer

    dtype = torch.float32 if name == "adamw_fp32" else torch.bfloat16
    model, tok = load_model("default", dtype=dtype)
    train, val = build_datasets("default", tok, args.seq_len)
    kw = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if name == "adamw_fp32":
        return model, torch.optim.AdamW(model.parameters(), fused=True, **kw), train, val
    _round_to_nearest(name == "rtn_adamw8bit")
    return model, LeanOptimizer(AdamW8bit(model.parameters(), **kw), seed=args.seed), train, val


def written_per_param(optimizer) -> float:
    """Bytes the lean update writes per trainable parameter per step: the bf16 weights and every
    state tensor (all of it is rewritten each step), over the trainable elements."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    n = sum(p.numel() for p in params)
    state = sum(t.numel() * t.element_size() for p in params for t in optimizer.state[p].values())
    return (sum(p.numel() * p.element_size() for p in params) + state) / n


def run_one(name: str, args) -> dict:
    """Train run ``name``; its figures."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, opt, train_set, val = build(name, args)
    out = base.train_and_score(model, opt, train_set, val, argparse.Namespace(**{**vars(args), "run_name": name}))
    if name != "adamw_fp32":
        out["written_bytes_per_param_step"] = written_per_param(opt)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base.add_run_arguments(ap)
    ap.add_argument("--with-rtn", action="store_true", help="also the round-to-nearest ablation")
    ap.add_argument("--json", metavar="OUT", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.eval_batches = 3, 1
    if args.steps < 1 or args.threads < 1 or args.tail < 1:
        ap.error("--steps, --threads and --tail must be >= 1")
    names = ["adamw_fp32", "lean_adamw8bit"] + (["rtn_adamw8bit"] if args.with_rtn else [])
    runs = base.run_all(argparse.Namespace(**vars(args), sequential=False), tuple(names), run_one)
    ref = runs["adamw_fp32"]
    out: dict = {"steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
                 "threads_per_run": args.threads, "cpus": os.cpu_count(), "runs": runs}
    for name in names[1:]:
        r = runs[name]
        for key in ("final_train_loss", "last_loss", "val_loss"):
            r[f"rel_diff_{key}"] = (r[key] - ref[key]) / ref[key]
        r["within_1pct"] = abs(r["rel_diff_final_train_loss"]) <= 0.01 and abs(r["rel_diff_val_loss"]) <= 0.01
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"SmolLM2-135M, Shakespeare, {args.steps} steps, seq {args.seq_len}, batch {args.batch_size}, "
          f"lr {args.lr}, {args.threads} thread(s) per run")
    for name in names:
        r = runs[name]
        extra = "" if name == "adamw_fp32" else (
            f"  vs fp32: train {100 * r['rel_diff_final_train_loss']:+.2f}%, val {100 * r['rel_diff_val_loss']:+.2f}%"
            f" (within 1%: {r['within_1pct']}), writes {r['written_bytes_per_param_step']:.3f} B/param/step")
        print(f"{name:<15} first {r['first_loss']:.4f}  final(train, last {args.tail}) {r['final_train_loss']:.4f}"
              f"  val {r['val_loss']:.4f}  {r['s_per_step']:.2f} s/step{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
