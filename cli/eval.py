"""``outcore eval``: held-out perplexity and task accuracy of a model or of a run's result."""
from __future__ import annotations

import argparse
import json
from typing import Any

from .jsonout import emit_json

HELP = "score a model or a run: held-out perplexity, accuracy on a labelled task"
DESCRIPTION = """\
Evaluate a model (as --model of finetune: a Hugging Face directory, a .gguf file,
'default') or a run directory (its final/ model, on the run's own data, split,
sequence length, batch size and eval_task: the perplexity reproduces the run's
final eval loss).

Perplexity is measured on the held-out split finetune makes of --data (same seed,
val_fraction and seq_len). A task is a JSONL file, one example per line:
  {"query": "To be, or not to be, that is the", "choices": ["question", "answer"], "gold": 0}
({"question", "choices", "answer"} and ARC-style {"choices": {"text", "label"}, "answerKey"}
work too; 'shakespeare' names the 40-line task shipped with outcore). Each choice is
scored by the log-likelihood of " " + choice after the query, as lm-evaluation-harness
scores multiple choice: acc, and acc_norm (log-likelihood per character).

examples:
  outcore eval                                   # the embedded default on Shakespeare
  outcore eval runs/default --task shakespeare
  outcore eval ./my-llama --data notes.txt --offload nvme --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the eval options on ``parser``."""
    parser.add_argument("model", nargs="?", default="default", metavar="MODEL|RUN_DIR",
                        help="a model (HF directory, .gguf, 'default') or a run's output directory")
    parser.add_argument("--data", metavar="PATH", help="text data for the held-out perplexity "
                        "(default: the run's data, else 'default' when no --task is given)")
    parser.add_argument("--task", dest="eval_task", metavar="FILE", help="a labelled JSONL task, or 'shakespeare'")
    for flag, dest, typ, metavar, text in (
            ("--seq-len", "seq_len", int, "N", "tokens per held-out sequence"),
            ("--batch-size", "batch_size", int, "N", "sequences per batch"),
            ("--eval-batches", "eval_batches", int, "N", "held-out batches (0 = the whole split)"),
            ("--val-fraction", "val_fraction", float, "F", "share of the data held out"),
            ("--seed", "seed", int, "N", "seed of the held-out split"),
            ("--dtype", "dtype", str, "NAME", "float32 | bfloat16 | float16"),
            ("--offload", "offload", str, "MODE", "none (in memory, the default), cpu or nvme: stream the "
                                                  "weights through the tiers"),
            ("--swap-dir", "swap_dir", str, "DIR", "NVMe swap directory (default: a temporary one)"),
            ("--device-mem", "device_mem", str, "BYTES", "DEVICE tier budget, e.g. 2GiB"),
            ("--host-mem", "host_mem", str, "BYTES", "HOST tier budget"),
            ("--device", "device", str, "KIND", "where the model computes: auto (the GPU when there is one), "
                                                "cuda or cpu")):
        parser.add_argument(flag, dest=dest, type=typ, metavar=metavar, help=text)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the results; return 0.

    Raises:
        OutcoreError: a bad model, run, data, task file or option (the CLI prints it).
    """
    import outcore  # torch loads only now

    keys = ("seq_len", "batch_size", "eval_batches", "val_fraction", "seed", "dtype", "offload", "swap_dir",
            "device_mem", "host_mem")
    report = outcore.evaluate(args.model, data=args.data, task=args.eval_task,
                              **{k: getattr(args, k) for k in keys})
    if args.json:
        emit_json(json.dumps(report.to_dict()))
    else:
        print("\n".join(report_lines(report)))
    return 0


def report_lines(report: Any) -> list[str]:
    """The plain-text report, e.g. ``held-out perplexity  23.41  (loss 3.1532 over 4,096 tokens of default)``."""
    from ..tui.format import fmt_duration, fmt_float

    where = "in memory" if report.offload == "none" else f"streamed from {report.offload}"
    rows = []
    if report.eval_loss is not None:
        rows.append(("held-out perplexity", f"{fmt_float(report.perplexity, 2)}  (loss {fmt_float(report.eval_loss)} "
                                            f"over {report.eval_tokens:,} tokens of {report.data})"))
    if report.task is not None:
        t = report.task
        rows.append(("task accuracy", f"{t.task}: acc {t.acc:.1%} ± {t.acc_stderr:.1%} ({round(t.acc * t.n)}/{t.n}), "
                                      f"acc_norm {t.acc_norm:.1%} ± {t.acc_norm_stderr:.1%}"))
    rows.append(("wall time", fmt_duration(report.wall_s)))
    width = max(len(label) for label, _ in rows)
    return [f"outcore eval: {report.model} ({where})"] + [f"  {label:<{width}}  {value}" for label, value in rows]
