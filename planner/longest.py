"""The longest context that trains: the largest sequence length some configuration fits.

What a step holds grows with the sequence only through the activations
(``layout.activation_bytes``): per block its saved tensors (one tile of a tiled MLP) or its
checkpoint, and the chunked head's per-token rows. Weights, state and their windows do not
grow. So for each configuration the planner weighs (offload layout x activation policy;
``plan._layouts``) whether it fits is monotone in the length, and a binary search over the
length finds the longest of each; the longest of all, its estimated step time and where it
keeps the block checkpoints are what ``outcore plan`` reports, ``--seq-len max`` takes and a
``--seq-len`` that does not fit is refused with.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from ..activations.policy import ACTIVATION_HOMES
from .layout import Layout, Workload, account, step_time

MAX_SEQ_LEN = 1 << 24  # search bound: 16M tokens
ROUND = 256  # a length >= this is rounded down to a multiple of it (steady GEMM shapes)


@dataclass(frozen=True)
class LongestContext:
    """The longest sequence that trains at a micro-batch, and the configuration that gets there."""

    seq_len: int
    batch_size: int
    offload: str  # the layout's name
    activations: str  # the run-level activation policy
    step_s: float  # estimated step time at that length
    checkpoints: str  # where the block checkpoints live (activations.policy.ACTIVATION_HOMES)
    trained_len: int  # the model's max_position_embeddings (0: unknown)
    rope_scaling: str = ""  # the RoPE scaling its config sets ("yarn x4.0"; "": none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def setting(self) -> str:
        """The command-line options that reach it."""
        return f"--activations {self.activations} --batch-size {self.batch_size}"

    def describe(self) -> str:
        """One line: the length, where the checkpoints live, the step time, beyond training."""
        rope = (f"RoPE scaling {self.rope_scaling} (the model's config)" if self.rope_scaling else
                 "positions extrapolated: the model's config sets no RoPE scaling (rope_parameters)")
        beyond = (f"; beyond the {self.trained_len} tokens the model was trained at: {rope}"
                  if self.trained_len and self.seq_len > self.trained_len else "")
        return (f"{self.seq_len} tokens x batch {self.batch_size} ({self.setting}, offload {self.offload}: "
                f"{self.checkpoints}), step ~{_duration(self.step_s)}{beyond}")


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def _fits(w: Workload, lay: Layout, batch: int) -> bool:
    return account(w, lay, batch).over_budget(w.budgets) is None


def longest_context(w: Workload, layouts: Callable[[Workload], list[Layout]], batch: int,
                    up_to: int = MAX_SEQ_LEN) -> LongestContext | None:
    """The longest sequence any of ``layouts(w at that length)`` fits at micro-batch ``batch``.

    Args:
        w: the workload (its ``seq_len`` is replaced by each length tried).
        layouts: the configurations considered at a length (``plan._layouts``).
        batch: sequences per micro-batch.
        up_to: the longest length tried.

    Returns:
        The :class:`LongestContext` (the fastest configuration at that length), or None when
        not even one token fits.
    """
    def fitting(n: int) -> list[tuple[Layout, Workload]]:
        wn = replace(w, seq_len=n)
        return [(lay, wn) for lay in layouts(wn) if _fits(wn, lay, batch)]

    if not fitting(1):
        return None
    lo, hi = 1, 2
    while hi <= up_to and fitting(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, up_to + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fitting(mid) else (lo, mid)
    n = lo - lo % ROUND if ROUND <= lo < up_to else lo
    lay, wn = min(fitting(n), key=lambda c: step_time(c[1], c[0], batch).step_s)
    return LongestContext(seq_len=n, batch_size=batch, offload=lay.name(w.grads_kept), activations=lay.activations,
                          step_s=step_time(wn, lay, batch).step_s, checkpoints=ACTIVATION_HOMES[lay.activations],
                          trained_len=w.spec.trained_len, rope_scaling=w.spec.rope_scaling)
