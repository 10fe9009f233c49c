"""``outcore export``: a run's trained model as a Hugging Face directory, or as GGUF for llama.cpp / Ollama."""
from __future__ import annotations

import argparse

HELP = "write a run's trained model as a Hugging Face directory or a GGUF file"
DESCRIPTION = """\
Export the newest complete checkpoint of a fine-tuning run (full, LoRA merged into
the base, out of core, or zeroth-order replayed from its seed log) to a directory
that AutoModelForCausalLM.from_pretrained loads (--format hf), or to one GGUF file
with an Ollama Modelfile beside it (--format gguf), which llama.cpp and Ollama run.
With --format gguf the source may also be a model: 'default', a Hugging Face
directory or a .gguf file.

examples:
  outcore export runs/default
  outcore export runs/zo --output ./my-model
  outcore export runs/default --format gguf --gguf-type q8_0
  ollama create my-model -f runs/default/gguf/Modelfile
"""

FORMATS = ("hf", "gguf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the export options on ``parser``."""
    from ..recipes.export_gguf import GGUF_TYPES  # no torch: the module imports it lazily

    parser.add_argument("run", metavar="RUN_DIR|MODEL",
                        help="the run's output directory (--format gguf: or a model)")
    parser.add_argument("--format", choices=FORMATS, default="hf",
                        help="hf: a Hugging Face directory; gguf: a .gguf file + Ollama Modelfile (default: hf)")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES, default="f16",
                        help="the GGUF matrices' type; norms stay f32 (default: f16)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="where to write (default: RUN_DIR/export, or RUN_DIR/gguf for --format gguf)")


def run(args: argparse.Namespace) -> int:
    """Export, print the directory (hf) or file (gguf) written, return 0."""
    if args.format == "gguf":
        from ..recipes.export_gguf import export_run_gguf  # imports torch: only when export runs

        print(export_run_gguf(args.run, args.output, args.gguf_type))
        return 0
    from ..recipes.export import export_run

    print(export_run(args.run, args.output))
    return 0
