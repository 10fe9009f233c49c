"""The dashboard's per-rank panel of a ``torchrun`` run: each rank's step time, I/O stall,
RSS and tiers (bytes held, bandwidth), from the :class:`~outcore.events.RankStats` that
rank 0's StepEvent carries (gathered by the recipe at log steps; the ``tui`` never talks to
the other ranks itself).

rich is imported when the panel is drawn, never at import.
"""
from __future__ import annotations

from typing import Any

from .format import fmt_bytes, fmt_gbps, fmt_percent, fmt_seconds
from .state import as_tier_stats

_TIER_ORDER = {"DEVICE": 0, "HOST": 1, "NVME": 2}


def _get(stats: Any, name: str) -> Any:
    """A field of a RankStats, or of its dict form (an event that went through JSON)."""
    return stats.get(name) if isinstance(stats, dict) else getattr(stats, name)


def _tiers_text(tiers: dict[str, Any]) -> str:
    parts = []
    for name in sorted(tiers, key=lambda t: _TIER_ORDER.get(t.upper(), 9)):
        st = as_tier_stats(tiers[name])
        parts.append(f"{name} {fmt_bytes(st.held_bytes)}  r {fmt_gbps(st.read_gbps)}  w {fmt_gbps(st.write_gbps)}")
    return "   ".join(parts) if parts else "in memory"


def rank_panel(ranks: list[Any], width: int) -> Any:
    """A rich Panel with one row per rank.

    Args:
        ranks: every rank's RankStats (or dict), in rank order.
        width: the panel's width (the dashboard's).

    Returns:
        The panel.
    """
    from rich import box
    from rich.panel import Panel
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, pad_edge=False)
    for name, justify in (("rank", "right"), ("step", "right"), ("stall", "right"), ("RSS", "right"),
                          ("tiers: held, read, write", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "tiers: held, read, write")
    for stats in ranks:
        step_s, stall_s = _get(stats, "step_s"), _get(stats, "stall_s")
        share = stall_s / step_s if step_s else None
        table.add_row(str(_get(stats, "rank")), fmt_seconds(step_s), fmt_percent(share),
                      fmt_bytes(_get(stats, "rss_bytes")), _tiers_text(_get(stats, "tiers") or {}))
    slowest = max(ranks, key=lambda r: _get(r, "step_s") or 0.0)
    title = f"[bold]ranks[/] · {len(ranks)} · slowest rank {_get(slowest, 'rank')}"
    return Panel(table, title=title, title_align="left", box=box.ROUNDED, border_style="magenta",
                 width=width, padding=(0, 1))
