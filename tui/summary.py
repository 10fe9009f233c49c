"""The end-of-run summary: base vs final eval perplexity (and task accuracy), wall time, peak memory, paths.

``RunSummary`` is built by the fan-out sink at ``RunFinished`` from what it saw
during the run, then rendered by the view: :func:`summary_lines` as plain text
(CI logs, pipes, notebooks) or :func:`summary_panel` as a rich panel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..events import RunFinished
from .format import fmt_bytes, fmt_count, fmt_duration, fmt_float, perplexity


@dataclass
class RunSummary:
    """What a person wants to know when a run ends."""

    steps_done: int
    total_steps: int | None
    wall_s: float
    peak_rss_bytes: int
    interrupted: bool = False
    run_name: str | None = None
    model: str | None = None
    method: str | None = None
    optim: str | None = None
    ram_bytes: int | None = None  # machine RAM, to put the peak in proportion
    peak_device_bytes: int | None = None
    base_eval_loss: float | None = None
    final_eval_loss: float | None = None
    mean_tokens_per_s: float | None = None
    tokens_per_step: int | None = None  # the tokens one optimizer step trains on, over every rank
    activations: str | None = None  # where the saved activations lived (RunStarted.activations)
    objective: str | None = None  # what the run optimized (a preference loss has no perplexity)
    base_pref_accuracy: float | None = None  # a preference objective's held-out pairs, before training
    final_pref_accuracy: float | None = None  # ... and after the last step
    base_pref_margin: float | None = None
    final_pref_margin: float | None = None
    base_eval_reward: float | None = None  # GRPO: the held-out prompts' mean reward, before training
    final_eval_reward: float | None = None  # ... and after the last step
    task: str | None = None  # the eval task's name, when one was scored
    base_task_acc: float | None = None  # before training
    final_task_acc: float | None = None  # after the last step
    base_task_acc_norm: float | None = None
    final_task_acc_norm: float | None = None
    ssd_written_bytes: int | None = None  # bytes the run wrote to its swap disk (training/wear.py)
    ssd_life_used_pct: float | None = None  # with ssd_tbw: % of the drive's rated writes this run used
    ssd_life_per_1000_steps_pct: float | None = None  # ... and 1000 steps like these would use
    paths: dict[str, str] = field(default_factory=dict)  # label -> path (output, final model, metrics, ...)

    @property
    def base_perplexity(self) -> float | None:
        return perplexity(self.base_eval_loss)

    @property
    def final_perplexity(self) -> float | None:
        return perplexity(self.final_eval_loss)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (for scripts and tests)."""
        from dataclasses import asdict

        d = asdict(self)
        d["base_perplexity"] = self.base_perplexity
        d["final_perplexity"] = self.final_perplexity
        return d


def _ppl_change(summary: RunSummary) -> str:
    base, final = summary.base_perplexity, summary.final_perplexity
    if base is None or final is None:
        return ""
    if base > 0 and base != float("inf") and final != float("inf"):
        return f"  ({(final - base) / base * 100:+.1f}%)"
    return ""


def summary_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """The summary as ``(label, value)`` pairs, in display order.

    Args:
        summary: the finished run.

    Returns:
        Pairs such as ``("eval perplexity", "base 23.41 -> final 18.02  (-23.0%)")``.
    """
    rows: list[tuple[str, str]] = []
    steps = f"{summary.steps_done}" + (f"/{summary.total_steps}" if summary.total_steps else "")
    rows.append(("steps", steps + ("  (interrupted)" if summary.interrupted else "")))
    rows.append(("wall time", fmt_duration(summary.wall_s)))
    if summary.objective == "grpo":  # its eval loss is minus the held-out reward
        rows += _reward_rows(summary)
    elif summary.objective not in (None, "sft"):  # a preference loss: its perplexity means nothing
        rows += _preference_rows(summary)
    elif summary.final_eval_loss is not None:
        rows.append(("eval perplexity",
                     f"base {fmt_float(summary.base_perplexity, 2)} -> final "
                     f"{fmt_float(summary.final_perplexity, 2)}{_ppl_change(summary)}"))
        rows.append(("eval loss",
                     f"base {fmt_float(summary.base_eval_loss)} -> final {fmt_float(summary.final_eval_loss)}"))
    elif summary.base_eval_loss is not None:
        rows.append(("eval perplexity", f"base {fmt_float(summary.base_perplexity, 2)} (no final eval)"))
        rows.append(("eval loss", f"base {fmt_float(summary.base_eval_loss)}"))
    rows += _task_rows(summary)
    peak = fmt_bytes(summary.peak_rss_bytes)
    if summary.ram_bytes:
        peak += f" of {fmt_bytes(summary.ram_bytes)} RAM"
    rows.append(("peak RSS", peak))
    if summary.peak_device_bytes is not None:
        rows.append(("peak device memory", fmt_bytes(summary.peak_device_bytes)))
    if summary.mean_tokens_per_s is not None:
        rows.append(("throughput", f"{fmt_count(summary.mean_tokens_per_s)} tokens/s"))
    if summary.tokens_per_step:
        rows.append(("tokens/step", f"{summary.tokens_per_step:,}"))
    if summary.activations:
        rows.append(("activations", summary.activations))
    wear = wear_text(summary.ssd_written_bytes, None, summary.ssd_life_used_pct,
                     summary.ssd_life_per_1000_steps_pct)
    if wear and summary.ssd_life_used_pct is None:
        from ..training.wear import TYPICAL_TBW, life_used_pct  # (the run is over: torch is loaded)

        typical = life_used_pct(summary.ssd_written_bytes, TYPICAL_TBW)
        wear += f"; {typical:.2g}% of a typical 1 TB drive's rated life ({TYPICAL_TBW:g} TBW; --ssd-tbw for yours)"
    if wear:
        rows.append(("SSD written", wear))
    for label, path in summary.paths.items():
        rows.append((label, path))
    return rows


def wear_fields(event: RunFinished) -> dict[str, Any]:
    """The RunSummary fields of a finished run's SSD wear (its ``ssd_*`` fields)."""
    return {"ssd_written_bytes": event.ssd_written_bytes, "ssd_life_used_pct": event.ssd_life_used_pct,
            "ssd_life_per_1000_steps_pct": event.ssd_life_per_1000_steps_pct}


def wear_text(written: float | None, per_step: float | None, life_pct: float | None,
              per_1000_pct: float | None) -> str | None:
    """SSD wear as one phrase, the same on the dashboard, the plain log and the summary, e.g.
    ``1.2 GiB, 40.0 MiB/step; 0.0002% of rated life, 0.0067% per 1000 steps``.

    Args:
        written: bytes written to the swap disk this run (None: not measured).
        per_step: bytes per step (None: leave it out).
        life_pct, per_1000_pct: percent of the drive's rated writes used, and that 1000
            steps would use (None: no ``ssd_tbw`` given).

    Returns:
        The phrase, or None when nothing was measured.
    """
    if written is None:
        return None
    text = fmt_bytes(written) + (f", {fmt_bytes(per_step)}/step" if per_step is not None else "")
    if life_pct is not None:
        text += f"; {life_pct:.3g}% of rated life"
        if per_1000_pct is not None:
            text += f", {per_1000_pct:.3g}% per 1000 steps"
    return text


def _preference_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """``eval loss (dpo)  base 0.6931 -> final 0.6672``, then the held-out pairs' accuracy and margin."""
    rows, unit = [], "examples" if summary.objective == "kto" else "pairs"
    for label, base, final, fmt in (
            (f"eval loss ({summary.objective})", summary.base_eval_loss, summary.final_eval_loss, fmt_float),
            (f"{unit} accuracy", summary.base_pref_accuracy, summary.final_pref_accuracy, "{:.1%}".format),
            ("reward margin", summary.base_pref_margin, summary.final_pref_margin, "{:+.4f}".format)):
        parts = [f"base {fmt(base)}"] if base is not None else []
        parts += [f"final {fmt(final)}"] if final is not None else []
        if parts:
            rows.append((label, " -> ".join(parts)))
    return rows


def _reward_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """``held-out reward  base 0.1250 -> final 0.5625``."""
    parts = [f"{label} {value:.4f}" for label, value in (("base", summary.base_eval_reward),
                                                         ("final", summary.final_eval_reward)) if value is not None]
    return [("held-out reward", " -> ".join(parts))] if parts else []


def _task_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """``task accuracy  shakespeare_mc: base 17.5% -> final 30.0%`` and its ``acc_norm`` twin."""
    if summary.task is None:
        return []
    rows = []
    for label, base, final in (("task accuracy", summary.base_task_acc, summary.final_task_acc),
                               ("task acc_norm", summary.base_task_acc_norm, summary.final_task_acc_norm)):
        parts = [f"base {base:.1%}"] if base is not None else []
        parts += [f"final {final:.1%}"] if final is not None else []
        rows.append((label, f"{summary.task}: {' -> '.join(parts)}"))
    return rows


def _title(summary: RunSummary) -> str:
    what = "run interrupted" if summary.interrupted else "run finished"
    name = f" {summary.run_name}" if summary.run_name else ""
    return f"outcore{name}: {what}"


def summary_lines(summary: RunSummary) -> list[str]:
    """Plain-text summary: a title line, then one aligned ``label  value`` line per row."""
    rows = summary_rows(summary)
    width = max(len(label) for label, _ in rows)
    return [_title(summary)] + [f"  {label:<{width}}  {value}" for label, value in rows]


def summary_panel(summary: RunSummary) -> Any:
    """The summary as a rich Panel (rich imported here, lazily)."""
    from rich import box
    from rich.panel import Panel
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for label, value in summary_rows(summary):
        style = ""
        if label == "eval perplexity" and summary.base_perplexity and summary.final_perplexity:
            style = "green" if summary.final_perplexity < summary.base_perplexity else "red"
        elif label == "steps" and summary.interrupted:
            style = "yellow"
        table.add_row(label, f"[{style}]{_escape(value)}[/]" if style else _escape(value))
    return Panel(table, title=_title(summary), title_align="left", box=box.ROUNDED,
                 border_style="yellow" if summary.interrupted else "green", expand=False)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def summary_paths(output_dir: Path | None, final_dir: str | None, metrics: Path | None,
                  loss_curve: Path | None, interrupted: bool = False) -> dict[str, str]:
    """The output paths worth printing, only those that exist (or were just written).

    An interrupted run with checkpoints also gets the command that resumes it.
    """
    paths: dict[str, str] = {}
    if output_dir is not None:
        paths["output"] = str(output_dir)
    if final_dir:
        paths["final model"] = str(final_dir)
    if output_dir is not None and (output_dir / "config.yaml").is_file():
        paths["config"] = str(output_dir / "config.yaml")
    if metrics is not None and metrics.is_file():
        paths["metrics"] = str(metrics)
    if loss_curve is not None and loss_curve.is_file():
        paths["loss curve"] = str(loss_curve)
    if interrupted and output_dir is not None and (output_dir / "checkpoints").is_dir():
        paths["resume with"] = f"outcore finetune --resume {output_dir}"
    return paths
