"""``outcore doctor``: what this machine offers a run -- devices, RAM, the swap disk, backends --
and, with ``--model M``, whether that model's family streams out of core (and why not).

It renders ``outcore.offload.store.probe.probe_hardware(swap_dir, measure=...)``
(``HardwareProbe.to_dict()``) as a table a person reads before a long run, with
every warning in yellow, or as one JSON object with ``--json`` for scripts.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..tui.format import fmt_bytes, fmt_gbps
from .jsonout import emit_json

HELP = "show devices, memory, swap-disk bandwidth and backends"
DESCRIPTION = """\
Probe this machine: compute devices and their memory, RAM, CPU threads, the
swap directory's free space, filesystem and measured O_DIRECT read/write
bandwidth (a few seconds), host<->device copy bandwidth, optional backends, and
the warnings a run would hit. With --model, also whether that model streams out
of core: read from its config alone (built on the meta device, no weight read).
"""

# keys rendered in their own section; anything else the probe adds goes under "other"
_KNOWN = {"cpu_threads", "ram_total_bytes", "ram_available_bytes", "devices", "swap_dir",
          "swap_free_bytes", "swap_fs_type", "o_direct", "disk_read_gbps", "disk_write_gbps",
          "h2d_gbps", "d2h_gbps", "backends", "warnings", "leftover_swap_dirs", "model"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the doctor options on ``parser``."""
    parser.add_argument("--swap-dir", metavar="DIR", default=None,
                        help="the swap directory to probe (default: the one a run would use)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--no-measure", action="store_true",
                        help="skip the bandwidth measurements (instant)")
    parser.add_argument("--model", metavar="M", default=None,
                        help="also say whether this model (directory, .gguf, hub id) streams out of core")


def probe(swap_dir: str | None, measure: bool) -> dict[str, Any]:
    """Run the hardware probe and return its dict form.

    Raises:
        OutcoreError: e.g. SwapDirError for a swap directory that is missing or not writable.
    """
    from ..offload.store import probe_hardware  # may import torch: only when doctor runs

    return probe_hardware(swap_dir, measure=measure).to_dict()


def model_report(spec: str, ram_available: int | None) -> dict[str, Any]:
    """Whether the model ``spec`` streams out of core, from its config alone (no weight read).

    Args:
        spec: a model spec (as ``--model``).
        ram_available: bytes of RAM available (says whether ``--offload none`` would fit).

    Returns:
        ``{"spec", "family", "class", "parameters", "blocks", "tested", "streams", "reason"}``.

    Raises:
        ModelError: the spec or its config cannot be read.
    """
    from ..errors import ModelError
    from ..models import SUPPORTED_MODEL_TYPES, check_streamable, count_parameters, meta_model, read_model_config

    model = meta_model(read_model_config(spec))
    family = model.config.model_type
    report = {"spec": spec, "family": family, "class": type(model).__name__,
              "parameters": count_parameters(model), "tested": family in SUPPORTED_MODEL_TYPES}
    try:
        parts = check_streamable(model, ram_available)
    except ModelError as err:
        return {**report, "blocks": None, "streams": False, "reason": str(err)}
    layout = f"embed, {len(parts.layers)} blocks, final norm, {'tied' if parts.tied else 'own'} head"
    reason = ("a tested family" if report["tested"] else
              f"its layout is understood, but {family} is not among the tested families "
              f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    return {**report, "blocks": len(parts.layers), "streams": True, "reason": f"{reason}: {layout}"}


def largest_report(free_bytes: int | None) -> dict[str, Any] | None:
    """The largest reference shape a full fine-tune in the write-lean mode fits on the swap disk
    (``planner.largest``), and the next one up with what it needs; None without a free figure."""
    from ..planner.largest import HEADROOM, largest_full_finetune, swap_bytes_per_shape

    if not free_bytes:
        return None
    fit = largest_full_finetune(free_bytes)
    bigger = [f for f in swap_bytes_per_shape() if fit is None or f.swap_bytes > fit.swap_bytes]
    return {"mode": "precision=bf16-lean optim=adamw8bit", "headroom": HEADROOM,
            "fits": fit.to_dict() if fit else None, "next": bigger[0].to_dict() if bigger else None}


def run(args: argparse.Namespace) -> int:
    """Probe, then print a table (or JSON with ``--json``). Returns 0."""
    data = probe(args.swap_dir, measure=not args.no_measure)
    if args.model:
        data["model"] = model_report(args.model, data.get("ram_available_bytes"))
    if args.json:
        emit_json(json.dumps(data, indent=2, default=str))
        return 0
    from rich.console import Console

    Console().print(render(data, measured=not args.no_measure, largest=largest_report(data.get("swap_free_bytes"))))
    return 0


# ---------------------------------------------------------------------------------
def _bytes_pair(used_label: str, total: Any, avail: Any) -> str:
    if avail is None:
        return fmt_bytes(total)
    return f"{fmt_bytes(total)} total, {fmt_bytes(avail)} {used_label}"


def _device_line(dev: Any) -> str:
    if not isinstance(dev, dict):
        return str(dev)
    name = dev.get("name", "device")
    parts = [str(name)]
    if dev.get("total_bytes") is not None:
        parts.append(_bytes_pair("free", dev.get("total_bytes"), dev.get("free_bytes")))
    rest = {k: v for k, v in dev.items() if k not in ("name", "total_bytes", "free_bytes")}
    parts += [f"{k} {_value(k, v)}" for k, v in rest.items()]
    return ", ".join(parts)


def _value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key.endswith("_bytes") and isinstance(value, (int, float)):
        return fmt_bytes(value)
    if key.endswith("_gbps") and isinstance(value, (int, float)):
        return fmt_gbps(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def _bandwidth(read: Any, write: Any, what: tuple[str, str], measured: bool) -> str:
    if read is None and write is None:
        return "not measured" + ("" if measured else " (--no-measure)")
    return f"{what[0]} {fmt_gbps(read)}   {what[1]} {fmt_gbps(write)}"


def _largest_line(report: dict[str, Any]) -> str:
    """``llama3-8b shape (8.03B parameters, 32.1 GB of swap) in bf16-lean + AdamW8bit; 14b needs 59.1 GB``."""
    fit, bigger = report.get("fits"), report.get("next")
    head = (f"largest: the {fit['shape']} shape ({fit['params'] / 1e9:.2f}B parameters, "
            f"{fmt_bytes(fit['swap_bytes'])} of swap)" if fit else "no reference shape fits")
    tail = f"; {bigger['shape']} needs {fmt_bytes(bigger['swap_bytes'])}" if bigger else ""
    return f"{head} with {report.get('mode')}{tail}"


def _model_rows(table: Any, report: dict[str, Any], section: Any) -> None:
    from rich.markup import escape

    section("Model")
    table.add_row("  model", escape(str(report.get("spec"))))
    table.add_row("  family", escape(f"{report.get('family')} ({report.get('class')}), "
                                     f"{report.get('parameters', 0):,} parameters"))
    verdict = "[green]yes[/]" if report.get("streams") else "[yellow]no[/]"
    table.add_row("  out of core", f"{verdict}: {escape(str(report.get('reason')))}")


def render(data: dict[str, Any], measured: bool = True, largest: dict[str, Any] | None = None) -> Any:
    """The probe as a rich renderable: sections System, Devices, Swap directory, Backends,
    Leftover swap directories, Model (with ``--model``), Warnings (yellow).

    Args:
        data: ``HardwareProbe.to_dict()``.
        measured: whether bandwidths were asked for (explains a missing figure).
        largest: :func:`largest_report` of the swap disk's free space (a line under it).

    Returns:
        A rich ``Table`` (a grid with section headings).
    """
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE, show_header=False, title="outcore doctor", title_justify="left",
                  title_style="bold magenta", padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()

    def section(name: str) -> None:
        table.add_row(f"[bold]{name}[/]", "", end_section=False)

    section("System")
    table.add_row("  CPU threads", str(data.get("cpu_threads", "-")))
    table.add_row("  RAM", _bytes_pair("available", data.get("ram_total_bytes"),
                                       data.get("ram_available_bytes")))
    section("Devices")
    devices = data.get("devices") or []
    if devices:
        for i, dev in enumerate(devices):
            table.add_row(f"  {i}", escape(_device_line(dev)))
    else:
        table.add_row("  none", "[dim]CPU only: the DEVICE tier is a RAM arena[/]")
    if data.get("h2d_gbps") is not None or data.get("d2h_gbps") is not None or devices:
        label = "  host<->device" if devices else "  RAM copy"
        table.add_row(label, _bandwidth(data.get("h2d_gbps"), data.get("d2h_gbps"), ("h2d", "d2h"),
                                        measured))

    section("Swap directory")
    table.add_row("  path", escape(str(data.get("swap_dir", "-"))))
    free = fmt_bytes(data.get("swap_free_bytes"))
    fs = data.get("swap_fs_type")
    table.add_row("  free", f"{free} on {escape(str(fs))}" if fs else free)
    o_direct = data.get("o_direct")
    table.add_row("  O_DIRECT", "-" if o_direct is None else
                  ("[green]yes[/]" if o_direct else "[yellow]no (reads may hit the page cache)[/]"))
    table.add_row("  bandwidth", _bandwidth(data.get("disk_read_gbps"), data.get("disk_write_gbps"),
                                            ("read", "write"), measured))
    if largest:
        table.add_row("  full fine-tune", escape(_largest_line(largest)))

    section("Backends")
    backends = data.get("backends") or {}
    for name, version in sorted(backends.items()):
        table.add_row(f"  {escape(name)}", escape(str(version)) if version else "[dim]not installed[/]")

    leftovers = data.get("leftover_swap_dirs") or []
    if leftovers:
        section("Leftover swap directories")
        for path in leftovers:
            table.add_row("", f"[yellow]{escape(str(path))}[/]")

    if data.get("model"):
        _model_rows(table, data["model"], section)

    other = {k: v for k, v in data.items() if k not in _KNOWN}
    if other:
        section("Other")
        for key, value in other.items():
            table.add_row(f"  {escape(key)}", escape(_value(key, value)))

    warnings = data.get("warnings") or []
    section("Warnings")
    if warnings:
        for w in warnings:
            table.add_row("  [yellow]![/]", f"[yellow]{escape(str(w))}[/]")
    else:
        table.add_row("", "[green]none[/]")
    return table
