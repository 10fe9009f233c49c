"""``outcore generate``: complete prompts with a model or a run's trained model (batch, ``--json``).

Also the options ``outcore chat`` shares (the model, where its weights live, how to sample)
and how both open the model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..dtypes import DTYPES
from ..offload.modes import AUTO, DEVICE_CHOICES, OFFLOAD_MODES
from .jsonout import emit_json

HELP = "complete prompts with a model or a fine-tuning run's result"
STREAMING_NOTE = """\
A model that does not fit in memory streams its weights through the tiers
(--offload nvme|cpu, or auto), with the prefetch of training: every generated
token is one forward, so one pass of ALL the weights through the tiers (the
prompts of one call share it). In memory (--offload none) nothing moves."""
DESCRIPTION = f"""\
Generate from each PROMPT with transformers' generate (its KV cache): greedy by
default (--temperature 0), sampled above 0. The prompts are generated together,
in one batch. MODEL is anything `outcore finetune --model` takes (default, a
Hugging Face directory, a .gguf file, a hub id) or a run directory (its final/
model, or its newest checkpoint).

{STREAMING_NOTE}

examples:
  outcore generate default "Write a haiku about the sea."
  outcore generate runs/default "To be, or not to be" --no-chat --max-new-tokens 40
  outcore generate runs/default "Hi" "Who are you?" --json
"""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and where its weights live (``generate`` and ``chat``)."""
    parser.add_argument("model", metavar="MODEL|RUN_DIR",
                        help="default, a Hugging Face directory, a .gguf file, a hub id, or a run directory")
    parser.add_argument("--offload", choices=OFFLOAD_MODES, default=AUTO,
                        help="where the weights live: none (in memory), cpu or nvme (streamed through the "
                             "tiers), auto (in memory when they take at most half the free RAM; default)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the weights' dtype (default float32)")
    parser.add_argument("--swap-dir", metavar="DIR", default=None,
                        help="NVMe swap directory with --offload nvme (default: under the outcore cache)")
    parser.add_argument("--prefetch", metavar="K", type=int, default=2,
                        help="units read ahead of the one computing when streamed (default 2)")
    parser.add_argument("--device", choices=DEVICE_CHOICES[:3], default="auto",
                        help="where the model computes: auto (the GPU when there is one; default), cuda or cpu")


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """How tokens are chosen (``generate`` and ``chat``)."""
    parser.add_argument("--max-new-tokens", metavar="N", type=int, default=max_new_tokens,
                        help=f"the most tokens generated per answer (default {max_new_tokens})")
    parser.add_argument("--temperature", metavar="T", type=float, default=0.0,
                        help="0 decodes greedily (default); above 0 samples (with the model's top-k/top-p)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")


def open_generator(args: argparse.Namespace) -> Any:
    """Load the model the arguments name (``recipes.generate.load_generator``), quietly."""
    from transformers.utils import logging as hf_logging

    from ..recipes.generate import load_generator

    hf_logging.disable_progress_bar()  # the "Loading weights" bars would interleave with the output
    return load_generator(args.model, offload=args.offload, dtype=args.dtype, swap_dir=args.swap_dir,
                          prefetch=args.prefetch, device=args.device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the generate options on ``parser``."""
    add_model_arguments(parser)
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="the prompts (each one argument)")
    add_sampling_arguments(parser, max_new_tokens=64)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the model's chat template to each prompt (default: when it has one)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: the model, the timing and each completion")


def run(args: argparse.Namespace) -> int:
    """Generate, print the completions (or JSON), return 0."""
    from ..recipes.generate import check_request

    check_request(args.prompts, args.max_new_tokens, args.temperature)  # before a model is loaded
    with open_generator(args) as generator:
        t0 = time.perf_counter()
        completions = generator.generate(args.prompts, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, seed=args.seed, chat=args.chat)
        seconds = time.perf_counter() - t0
        offload, stall_s, tiers = generator.offload, generator.stall_s, generator.tier_stats()
    tokens = sum(len(c.token_ids) for c in completions)
    if args.json:
        emit_json(json.dumps({"model": args.model, "offload": offload, "seconds": round(seconds, 3),
                          "new_tokens": tokens, "stall_s": round(stall_s, 3),
                          "tiers": {name: {"held_bytes": t.held_bytes, "read_bytes": t.read_bytes}
                                    for name, t in tiers.items()},
                          "completions": [vars(c) for c in completions]}, indent=1))
        return 0
    for i, c in enumerate(completions):
        if len(completions) > 1:
            print(f"{'' if i == 0 else chr(10)}[{i + 1}] {c.prompt}")
        print(c.text.strip())
    sys.stdout.flush()  # the completions before the summary line when both go to one terminal
    print(f"{len(completions)} prompt{'s' * (len(completions) > 1)}, {tokens} new tokens in {seconds:.1f} s "
          f"({tokens / max(seconds, 1e-9):.1f} tokens/s), offload {offload}", file=sys.stderr)
    return 0
