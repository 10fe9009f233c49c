"""The choice behind ``--offload auto`` and ``--activations auto``: one rule, in one place.

The planner (``plan.py``) lays out each configuration it considers — an offload layout
(``none``: all on DEVICE; ``cpu``: streamed from HOST; ``nvme``: streamed from NVMe; the
greedy ``mixed`` spill of ``auto``) under an activation policy (``keep``, ``recompute``) —
and describes it as a :class:`Candidate`: whether it fits every budget, its estimated step
time and the bytes it writes to the SSD per step. :func:`choose` then takes, among those that
fit, the fastest; but among those within 10% of the fastest (:data:`NEAR_FASTEST`), the one
that writes least: an SSD is rated for a number of terabytes written, and a step a little
slower that writes far less is the better trade for a long run (issue #14). Ties: the faster,
then the one considered first.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..activations.policy import OFFLOAD
from ..bytesize import format_bytes
from .layout import Layout, StepTime, Workload, account, activation_bytes

#: a candidate this much slower than the fastest still competes on the bytes it writes
NEAR_FASTEST = 0.10


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner considered, as ``outcore plan`` lists it."""

    offload: str  # the layout's name: none | cpu | nvme | mixed
    activations: str  # keep | recompute | offload
    fits: bool
    step_s: float  # the estimated step time (layout.step_time)
    written_bytes: int  # bytes written to the SSD per step (estimated)
    over: str | None = None  # what does not fit: "HOST 3.1 GiB > budget 2.0 GiB"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def written_per_step(w: Workload, lay: Layout, batch: int, st: StepTime) -> int:
    """Bytes one step of ``lay`` writes to the SSD: the swap file's write-backs (weights, optimizer
    state, spilled gradients: ``st.io_bytes["nvme_write"]``) and, with activation policy
    ``offload``, the activations the blocks save (the planner's HOST figure for them); with
    ``recompute_nvme`` the block checkpoints, counted by ``step_time``."""
    acts = activation_bytes(w, lay.activations, batch, lay.prefetch)[1] if lay.activations == OFFLOAD else 0
    return int(st.io_bytes["nvme_write"]) + int(acts)  # (offloaded checkpoints are in nvme_write)


def describe(w: Workload, lay: Layout, batch: int, st: StepTime) -> Candidate:
    """The :class:`Candidate` of layout ``lay`` at micro-batch ``batch`` with step time ``st``."""
    over = account(w, lay, batch).over_budget(w.budgets)
    why = None if over is None else f"{over[0]} {format_bytes(over[2])} > budget {format_bytes(over[1])}"
    return Candidate(offload=lay.name(w.grads_kept), activations=lay.activations, fits=over is None,
                     step_s=st.step_s, written_bytes=written_per_step(w, lay, batch, st), over=why)


def choose(candidates: Sequence[Candidate]) -> int | None:
    """Which candidate ``auto`` takes (see the module doc for the rule).

    Args:
        candidates: the configurations considered, in the order they were considered.

    Returns:
        The index of the chosen one, or None when none fits.
    """
    fitting = [i for i, c in enumerate(candidates) if c.fits]
    if not fitting:
        return None
    fastest = min(candidates[i].step_s for i in fitting)
    near = [i for i in fitting if candidates[i].step_s <= fastest * (1.0 + NEAR_FASTEST)]
    return min(near, key=lambda i: (candidates[i].written_bytes, candidates[i].step_s, i))
