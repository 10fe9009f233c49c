"""Plain-text rendering of a :class:`~outcore.planner.plan.MemoryPlan` (``outcore plan``).

Pure string formatting over the plan's numbers (and the configurations the planner
weighed, the chosen one starred): no torch, no rich (the CLI may
wrap the text in a rich panel). Consecutive blocks with the same placement and
sizes are folded into one row (``block.0-23 x24``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..bytesize import format_bytes
from ..offload.modes import NONE
from .budget import RUNTIME_OVERHEAD_BYTES
from .choice import NEAR_FASTEST

if TYPE_CHECKING:  # pragma: no cover
    from .plan import MemoryPlan, UnitPlacement

_LINK_NAMES = {"nvme_read": "NVMe -> HOST", "nvme_write": "HOST -> NVMe", "h2d": "HOST -> DEVICE",
               "d2h": "DEVICE -> HOST"}


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def _where(u: "UnitPlacement") -> str:
    def name(t):
        return t.name if t is not None else "-"
    grads = name(u.grads) if u.grads_bytes else "-"
    if u.grads_bytes and u.grads is None:
        grads = "freed after update"
    return f"{name(u.weights)} / {grads} / {name(u.state)}"


def _unit_rows(plan: "MemoryPlan") -> list[tuple[str, "UnitPlacement"]]:
    """(label, placement) rows with runs of identical blocks folded together."""
    rows: list[tuple[str, "UnitPlacement", int, int]] = []  # label base, unit, first, count
    for u in plan.units:
        if u.name.startswith("block.") and rows and rows[-1][1].name.startswith("block."):
            prev = rows[-1][1]
            same = (prev.weights_bytes, prev.grads_bytes, prev.state_bytes, _where(prev)) == \
                   (u.weights_bytes, u.grads_bytes, u.state_bytes, _where(u))
            if same:
                label, unit, first, count = rows[-1]
                rows[-1] = (label, unit, first, count + 1)
                continue
        first = int(u.name.split(".")[1]) if u.name.startswith("block.") else -1
        rows.append((u.name, u, first, 1))
    out = []
    for label, unit, first, count in rows:
        if count > 1:
            label = f"block.{first}-{first + count - 1} x{count}"
        out.append((label, unit))
    return out


def _grad_mode(plan: "MemoryPlan") -> str:
    if not any(u.grads_bytes for u in plan.units):
        return "none"
    if plan.layout == NONE:
        return "held in memory"
    return "kept until all exist" if plan.grads_kept else "freed per unit (step-in-backward)"


def render_table(plan: "MemoryPlan") -> str:
    """The plan as an aligned plain-text report (what lives where, bytes per tier, step time)."""
    lines = []
    trainable = f"{_count(plan.trainable)} trainable" if plan.trainable != plan.params else "all trainable"
    lines.append(f"outcore plan: {plan.model_type}, {_count(plan.params)} params ({trainable}); "
                 f"{plan.method} / {plan.optim} / {plan.dtype}; seq {plan.seq_len} x batch {plan.batch_size}")
    lines.append(f"offload {plan.offload} -> {plan.layout}   activations {plan.activations}   "
                 f"prefetch depth {plan.prefetch_depth}   largest micro-batch {plan.max_micro_batch}   "
                 f"gradients {_grad_mode(plan)}")
    lines.append("")
    lines.append(f"{'tier':<8}{'holds':<58}{'bytes':>12}{'budget':>12}{'use':>6}")
    for tier, parts in plan.tier_bytes.items():
        total = sum(parts.values())
        budget = plan.budget(tier)
        holds = ", ".join(f"{p} {format_bytes(v)}" for p, v in sorted(parts.items(), key=lambda x: -x[1])) or "-"
        use = f"{100 * total / budget:.0f}%" if budget and budget < (1 << 61) else "-"
        bud = format_bytes(budget) if budget < (1 << 61) else "unlimited"
        first = True
        while holds or first:  # wrap long "holds" lists onto continuation lines
            chunk, holds = (holds, "") if len(holds) <= 56 else (holds[:holds.rfind(", ", 0, 56) + 1],
                                                                 holds[holds.rfind(", ", 0, 56) + 2:])
            if first:
                lines.append(f"{tier:<8}{chunk:<58}{format_bytes(total):>12}{bud:>12}{use:>6}")
            else:
                lines.append(f"{'':<8}{chunk}")
            first = False
    lines.append(f"expected peak RSS ~ {format_bytes(plan.expected_peak_rss_bytes)} "
                 f"(RAM tiers + {format_bytes(RUNTIME_OVERHEAD_BYTES)} runtime)")
    lines.append("")
    lines.append(f"{'unit':<22}{'weights':>12}{'grads':>12}{'state':>12}   where: weights / grads / state")
    for label, u in _unit_rows(plan):
        lines.append(f"{label:<22}{format_bytes(u.weights_bytes):>12}{format_bytes(u.grads_bytes):>12}"
                     f"{format_bytes(u.state_bytes):>12}   {_where(u)}")
    lines.append("")
    t = plan.time
    lines.append(f"step (estimate): {t.step_s:.2f} s = compute {t.compute_s:.2f} s + optimizer update "
                 f"{t.update_s:.2f} s, I/O not hidden {t.exposed_io_s:.2f} s")
    moved = [(k, v) for k, v in t.io_bytes.items() if v]
    if moved:
        lines.append(f"{'link':<18}{'bytes/step':>14}{'time':>10}")
        for k, v in moved:
            lines.append(f"{_LINK_NAMES.get(k, k):<18}{format_bytes(v):>14}{t.io_s[k]:>9.2f}s")
    else:
        lines.append("no tier traffic: everything stays on DEVICE")
    if plan.blocks_tiled:
        lines.append(f"recomputed blocks tiled: {plan.seq_tile} positions per tile (seq_tile)")
    elif plan.seq_tile:
        lines.append(f"MLP tiled: {plan.seq_tile} tokens per tile (seq_tile)")
    if plan.longest is not None:
        lines.append(f"longest context that fits: {plan.longest.describe()}")
    lines += _candidate_rows(plan)
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _candidate_rows(plan: "MemoryPlan") -> list[str]:
    """The configurations the planner weighed, the chosen one starred (choice.py's rule)."""
    if not plan.candidates:
        return []
    lines = ["", f"configurations considered (the fastest that fits; within {NEAR_FASTEST:.0%} of it, "
                 "the one writing least to the SSD):",
             f"  {'offload':<9}{'activations':<13}{'step (est.)':>12}{'SSD writes/step':>17}   fits"]
    for i, c in enumerate(plan.candidates):
        mark = "*" if i == plan.chosen else " "
        fits = "yes" if c.fits else f"no: {c.over}"
        lines.append(f"{mark} {c.offload:<9}{c.activations:<13}{c.step_s:>11.2f}s"
                     f"{format_bytes(c.written_bytes):>17}   {fits}")
    return lines
