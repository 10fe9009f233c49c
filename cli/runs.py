"""``outcore runs``: the runs under a folder, with their status, steps and last eval loss."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..tui.format import fmt_float
from .jsonout import emit_json

HELP = "list the runs under a folder: finished, running, interrupted (resumable) or failed"
DESCRIPTION = """\
List the fine-tuning runs under DIR (default runs/; any folder holding a config.yaml
is a run) with their status, steps done out of max steps, last eval loss (the final
one for a finished run), method and model.

  finished     reached max_steps; final/ written (outcore export RUN --format gguf)
  running      out of core, its swap directory held by a live process
  interrupted  stopped with a checkpoint: outcore finetune --resume RUN continues it
               (a run still going shows here too)
  failed       stopped before its first checkpoint: nothing to resume

examples:
  outcore runs
  outcore runs experiments/ --json
"""

COLUMNS = ("run", "status", "steps", "eval loss", "method", "model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the runs options on ``parser``."""
    parser.add_argument("dir", metavar="DIR", nargs="?", default="runs", help="a folder of runs (default: runs)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per run")


def run(args: argparse.Namespace) -> int:
    """Print the runs as a table (rich on a terminal) or JSON. Returns 0."""
    from ..training.runs import describe_run, find_runs
    from ..tui.metrics import METRICS_FILENAME, read_metrics

    infos = [describe_run(path, read_metrics(path / METRICS_FILENAME)) for path in find_runs(args.dir)]
    if args.json:
        emit_json(json.dumps([i.to_json() for i in infos], indent=1))
        return 0
    if not infos:
        print(f"no runs under {args.dir} (a run is a folder holding config.yaml)")
        return 0
    rows = [_row(i, args.dir) for i in infos]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*COLUMNS)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    else:
        print(plain_table(rows))
    return 0


def _row(info: Any, root: str) -> tuple[str, ...]:
    """One run's cells: its path under ``root``, status (with what a resume continues from)."""
    from pathlib import Path

    name = str(info.path.relative_to(root)) if info.path != Path(root) else str(info.path)
    status = info.status if info.resume_step is None else f"{info.status} (resume from step {info.resume_step})"
    steps = f"{info.steps_done}/{info.max_steps}" if info.max_steps is not None else str(info.steps_done)
    status = status if info.status != "failed" else f"{status}: {info.note}"
    return (name, status, steps, fmt_float(info.eval_loss), info.method or "-", info.model or "-")


def plain_table(rows: list[tuple[str, ...]]) -> str:
    """Rows under :data:`COLUMNS`, each column padded to its widest cell."""
    cells = [tuple(c.upper() for c in COLUMNS), *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)
