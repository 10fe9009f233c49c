"""The memory plan's expectations next to what scripts/bench_step.py measured.

The plan is made as ``outcore plan`` makes it after ``outcore doctor`` measured the
machine: budgets and speeds from ``probe_hardware(swap_dir, measure=True)`` (the swap
directory's disk read and written with outcore's own I/O engine, the copy speed, the
matmul FLOP/s). Its step estimate is then set against the measured median step:
``plan_error`` is ``plan / measured - 1`` (the issue asks for it within ±20%).
"""
from __future__ import annotations

from typing import Any


def measured_budgets(swap_dir: str):
    """The budgets ``outcore plan`` would use here: probed, with the disk and copies measured
    (the matmul rate is measured by the plan, in its compute dtype)."""
    from outcore.offload.store import probe_hardware
    from outcore.planner import budgets_from_probe

    return budgets_from_probe(probe_hardware(swap_dir, measure=True, seconds=2.0))


def plan_estimate(config: Any, budgets: Any, *, offload: str, optim: str, dtype: str, seq: int, batch: int,
                  activations: str = "keep") -> dict[str, Any]:
    """What the plan expects of one outcore run: step time and its parts, bytes per link.

    Returns:
        The estimate's figures, or ``{"error": ...}`` when no layout fits (a result too).
    """
    from outcore.planner import make_plan

    try:
        plan = make_plan(config, offload=offload, optim=optim, dtype=dtype, seq_len=seq, batch_size=batch,
                         activations=activations, budgets=budgets)
    except Exception as e:  # noqa: BLE001 - a plan that does not fit is a result too
        return {"error": str(e)}
    t = plan.time
    return {"step_s": t.step_s, "compute_s": t.compute_s, "update_s": t.update_s,
            "exposed_io_s": t.exposed_io_s, "disk_s": t.disk_s, "prefetch_depth": plan.prefetch_depth,
            "expected_peak_rss_bytes": plan.expected_peak_rss_bytes,
            "nvme_read_bytes": t.io_bytes["nvme_read"], "nvme_write_bytes": t.io_bytes["nvme_write"]}


def plan_error(estimate: dict[str, Any], measured: dict[str, Any]) -> float | None:
    """``plan step / measured median step - 1`` (None when either is missing)."""
    if "step_s" not in estimate or measured.get("status") != "ok" or not measured.get("median_step_s"):
        return None
    return estimate["step_s"] / measured["median_step_s"] - 1.0
