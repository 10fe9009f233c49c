"""``outcore export``: a run's latest checkpoint as a Hugging Face directory."""
from __future__ import annotations

import argparse

HELP = "write a run's latest checkpoint as a Hugging Face model directory"
DESCRIPTION = """\
Export the newest complete checkpoint of a fine-tuning run (full, LoRA merged into
the base, out of core, or zeroth-order replayed from its seed log) to a directory
that AutoModelForCausalLM.from_pretrained loads.

examples:
  outcore export runs/default
  outcore export runs/zo --output ./my-model
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the export options on ``parser``."""
    parser.add_argument("run", metavar="RUN_DIR", help="the run's output directory")
    parser.add_argument("--output", metavar="DIR", default=None, help="where to write (default: RUN_DIR/export)")


def run(args: argparse.Namespace) -> int:
    """Export, print the directory written, return 0."""
    from ..recipes.export import export_run  # imports torch: only when export runs

    print(export_run(args.run, args.output))
    return 0
