"""``outcore finetune``: build a FinetuneConfig from YAML, ``key=value`` words and flags, then train.

Precedence, lowest to highest: the config's defaults, ``--config FILE.yaml``,
``key=value`` words, then flags (``--max-steps 10``). Only flags the user gave
are passed on (argparse defaults are suppressed), so a YAML value is never
overwritten by a flag's default.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..training.config import (ACTIVATION_COMPRESSION, ACTIVATION_POLICIES, METHODS, OBJECTIVES, OFFLOAD_MODES,
                              OPTIMIZERS, PRECISIONS, UI_MODES)

HELP = "fine-tune a model (no options: the embedded default)"
DESCRIPTION = f"""\
Fine-tune a causal language model. With no options it fine-tunes the embedded
default: SmolLM2-135M-Instruct on the Shakespeare corpus.

methods:     {', '.join(METHODS)}
objectives:  {', '.join(OBJECTIVES)} (preference objectives read JSONL prompt/chosen/rejected pairs;
             kto also prompt/completion/label rows)
optimizers:  {', '.join(OPTIMIZERS)}

Any config key can be set as key=value (e.g. lr=1e-4 eval_every=10
optim_args.rank=128); flags win over key=value, which wins over --config.

examples:
  outcore finetune
  outcore finetune --model ./my-llama --data notes.jsonl --max-steps 200 --output runs/notes
  outcore finetune --config run.yaml lr=2e-5 --resume runs/notes
"""

#: ``--seq-len max`` / ``seq_len=max``: the longest context the plan finds (cli/plan.py:take_longest)
SEQ_LEN_MAX = "max"


def seq_len_arg(text: str) -> "int | str":
    """``--seq-len``'s value: tokens, or ``max`` (argparse names this function in its error)."""
    return SEQ_LEN_MAX if text.strip().lower() == SEQ_LEN_MAX else int(text)


# (flag, FinetuneConfig field, type, metavar, help)
FLAGS: tuple[tuple[str, str, Any, str | None, str], ...] = (
    ("--model", "model", str, "PATH|ID",
     "local Hugging Face directory, a .gguf file, a hub id, or 'default'"),
    ("--data", "data", str, "PATH",
     "text file/folder or .jsonl (instruction, chat or preference data), or 'default'"),
    ("--method", "method", str, "NAME", f"one of: {', '.join(METHODS)}"),
    ("--objective", "objective", str, "NAME", f"one of: {', '.join(OBJECTIVES)}"),
    ("--optim", "optim", str, "NAME", f"one of: {', '.join(OPTIMIZERS)}"),
    ("--precision", "precision", str, "MODE", f"one of: {', '.join(PRECISIONS)} (bf16-lean: no fp32 master)"),
    ("--max-steps", "max_steps", int, "N", "optimizer steps"),
    ("--seq-len", "seq_len", seq_len_arg, "N|max",
     "tokens per training sequence; 'max': the longest the plan finds fits the budgets"),
    ("--batch-size", "batch_size", int, "N", "sequences per micro-batch"),
    ("--lr", "lr", float, "LR", "peak learning rate"),
    ("--seed", "seed", int, "N", "seed of data order and initialization"),
    ("--output", "output", str, "DIR", "output directory (metrics.jsonl, config.yaml, final/)"),
    ("--resume", "resume", str, "DIR", "resume from the last checkpoint in this output directory"),
    ("--offload", "offload", str, "MODE", f"where parameters and optimizer state live: {', '.join(OFFLOAD_MODES)}"),
    ("--device", "device", str, "KIND", "where the model computes: auto (the GPU when there is one), cuda or cpu"),
    ("--update-on", "update_on", str, "WHERE", "on a GPU, where the out-of-core update runs: device (the state "
     "streams to it) or host (the CPU updates the state in RAM; gradients and weights cross the link)"),
    ("--device-mem", "device_mem", str, "BYTES", "DEVICE tier budget, e.g. 6GiB"),
    ("--host-mem", "host_mem", str, "BYTES", "HOST tier budget, e.g. 16GiB"),
    ("--swap-dir", "swap_dir", str, "DIR", "NVMe swap directory (default: OUTPUT/swap)"),
    ("--activations", "activations", str, "POLICY", f"one of: {', '.join(ACTIVATION_POLICIES)}"),
    ("--activations-compress", "activations_compress", str, "CODEC",
     f"offloaded activations stored as: {', '.join(ACTIVATION_COMPRESSION)} (8-bit, per-block scales)"),
    ("--ssd-tbw", "ssd_tbw", float, "TB", "the swap disk's rated terabytes written: show the share of its life used"),
    ("--ui", "ui", str, "MODE", f"one of: {', '.join(UI_MODES)} (auto: rich on a terminal, else plain)"),
)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options that build a FinetuneConfig (``--config``, ``key=value``, the flags).

    Flag defaults are suppressed: a flag that is absent from the namespace was not given.
    Shared by ``finetune`` and ``plan``.
    """
    parser.add_argument("--config", metavar="FILE.yaml", default=None, help="a YAML file of config keys")
    parser.add_argument("overrides", nargs="*", metavar="key=value", default=[],
                        help="set any config key (e.g. lr=1e-4 optim_args.rank=64)")
    for flag, field_name, typ, metavar, help_text in FLAGS:
        parser.add_argument(flag, dest=field_name, type=typ, metavar=metavar, help=help_text,
                            default=argparse.SUPPRESS)
    parser.add_argument("--overwrite", dest="overwrite", action="store_true", default=argparse.SUPPRESS,
                        help="reuse an output directory that holds another run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the finetune options on ``parser``."""
    add_config_arguments(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config as YAML and exit without training")


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields set by flags on this command line (and only those)."""
    fields = [f for _, f, *_ in FLAGS] + ["overwrite"]
    return {f: getattr(args, f) for f in fields if hasattr(args, f)}


def config_from_args(args: argparse.Namespace) -> Any:
    """The FinetuneConfig of a command line built by :func:`add_config_arguments`.

    Raises:
        ConfigError: a missing or malformed --config file, an unknown key or a bad value.
    """
    from ..training.config import load_config

    flags, overrides = given_flags(args), list(args.overrides or [])
    if wants_longest(args):  # resolved by the plan once the config is known (cli/plan.py:take_longest)
        flags.pop("seq_len", None)
        overrides = [o for o in overrides if o.split("=", 1)[0].strip() != "seq_len"]
    return load_config(args.config, overrides, **flags)


def wants_longest(args: argparse.Namespace) -> bool:
    """Whether the command line asks for ``--seq-len max`` (or ``seq_len=max``; a flag wins)."""
    if hasattr(args, "seq_len"):
        return str(args.seq_len).strip().lower() == SEQ_LEN_MAX
    said = [o.split("=", 1)[1] for o in args.overrides or [] if o.split("=", 1)[0].strip() == "seq_len" and "=" in o]
    return bool(said) and said[-1].strip().lower() == SEQ_LEN_MAX


def _output_dir(result: Any, fallback: str) -> Path:
    out = getattr(result, "output_dir", None)
    if out is None and isinstance(result, dict):
        out = result.get("output_dir")
    return Path(out or fallback).resolve()


def run(args: argparse.Namespace) -> int:
    """Resolve the config and run ``outcore.finetune`` on it.

    Returns:
        0 when the run finished.

    Raises:
        OutcoreError: bad config, model, data or output directory (the CLI prints it).
    """
    config = config_from_args(args)
    if wants_longest(args):
        from .plan import take_longest

        config = take_longest(config)
    if args.dry_run:
        import yaml

        sys.stdout.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
        return 0
    import outcore  # the trainer (and torch) load only now

    result = outcore.finetune(config)
    from ..offload.distributed import from_env

    if from_env().is_main:  # under torchrun: once, by rank 0
        print(f"outcore: output in {_output_dir(result, config.output)}")
    return 0
