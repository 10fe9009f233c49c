"""What the views remember about a run: recent losses, evals, rates, ETA, tier deltas.

``RunState`` folds the event stream into the numbers a person reads (the
dashboard, the plain log lines and the summary all read the same state, so an
ETA or a bytes-per-step figure is computed once, the same way). It is cheap to
update (O(1) per event) because it runs on the trainer's thread.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..events import (EvalEvent, GRPOStepEvent, PreferenceEvalEvent, RewardEvalEvent, RunFinished, RunStarted,
                      StepEvent, TaskEvalEvent, TierStats)

HISTORY = 120  # loss points kept for sparklines


@dataclass
class TierView:
    """One tier as shown: the latest stats plus bytes written per step since the last event."""

    name: str
    stats: TierStats
    written_per_step: float | None  # None until two events have been seen
    read_per_step: float | None


def as_tier_stats(value: Any) -> TierStats:
    """A TierStats from a TierStats or its dict form (events that went through JSON)."""
    return value if isinstance(value, TierStats) else TierStats(**dict(value))


class RunState:
    """The folded view of a run's events (not thread-safe: guard it with the caller's lock)."""

    def __init__(self) -> None:
        self.started: RunStarted | None = None
        self.last: StepEvent | None = None
        self.finished: RunFinished | None = None
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.eval_losses: deque[float] = deque(maxlen=HISTORY)
        self.evals: list[tuple[int, float]] = []  # (step, eval_loss) from EvalEvents and StepEvents
        self.last_eval: tuple[int, float] | None = None
        self.task_evals: list[TaskEvalEvent] = []  # each scoring of the eval task, in step order
        self.preference_evals: list[PreferenceEvalEvent] = []  # a preference objective's held-out scores
        self.rollouts: GRPOStepEvent | None = None  # GRPO: the last logged step's completions
        self.reward_evals: list[RewardEvalEvent] = []  # GRPO: the held-out prompts' rewards
        self.tiers: dict[str, TierView] = {}
        self.peak_device_bytes: int | None = None
        self._first: tuple[int, float] | None = None  # (step, elapsed_s) of the first event seen
        self._tps_sum = 0.0
        self._tps_n = 0

    # ---------------------------------------------------------------------------
    def update(self, event: Any) -> None:
        """Fold one event into the state."""
        if isinstance(event, RunStarted):
            self.started = event
        elif isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, EvalEvent):
            self._eval(event.step, event.eval_loss)
        elif isinstance(event, TaskEvalEvent):
            self.task_evals.append(event)
        elif isinstance(event, PreferenceEvalEvent):
            self.preference_evals.append(event)
        elif isinstance(event, GRPOStepEvent):
            self.rollouts = event
        elif isinstance(event, RewardEvalEvent):
            self.reward_evals.append(event)
        elif isinstance(event, RunFinished):
            self.finished = event

    def _eval(self, step: int, loss: float) -> None:
        if self.last_eval == (step, loss):
            return  # the same eval reported by both an EvalEvent and its StepEvent
        self.last_eval = (step, loss)
        self.evals.append((step, loss))
        self.eval_losses.append(loss)

    def _step(self, ev: StepEvent) -> None:
        prev = self.last
        if self._first is None:
            self._first = (ev.step, ev.elapsed_s)
        self.losses.append(ev.loss)
        if ev.eval_loss is not None:
            self._eval(ev.step, ev.eval_loss)
        if ev.tokens_per_s and ev.tokens_per_s > 0:
            self._tps_sum += ev.tokens_per_s
            self._tps_n += 1
        if ev.device_bytes is not None:
            self.peak_device_bytes = max(self.peak_device_bytes or 0, ev.device_bytes)
        dsteps = ev.step - prev.step if prev is not None else 0
        tiers = {}
        for name, raw in ev.tiers.items():
            stats = as_tier_stats(raw)
            old = self.tiers.get(name)
            wps = rps = None
            if old is not None and dsteps > 0:
                wps = (stats.written_bytes - old.stats.written_bytes) / dsteps
                rps = (stats.read_bytes - old.stats.read_bytes) / dsteps
            elif prev is None and ev.step == 1:
                # first step of a fresh run: the counters started at 0 with it
                wps, rps = float(stats.written_bytes), float(stats.read_bytes)
            tiers[name] = TierView(name, stats, wps, rps)
        self.tiers = tiers
        self.last = ev

    # ---------------------------------------------------------------------------
    @property
    def total_steps(self) -> int | None:
        if self.last is not None:
            return self.last.total_steps
        return self.started.total_steps if self.started is not None else None

    def seconds_per_step(self) -> float | None:
        """Mean wall seconds per step between the first and the last event seen.

        Measured between events, not from step 1, so a resumed run (whose
        ``elapsed_s`` restarts) and ``log_every > 1`` both give the right rate;
        with a single event it is that step's own time.
        """
        ev = self.last
        if ev is None or self._first is None:
            return None
        first_step, first_elapsed = self._first
        if ev.step > first_step and ev.elapsed_s > first_elapsed:
            return (ev.elapsed_s - first_elapsed) / (ev.step - first_step)
        return ev.step_s if ev.step_s > 0 else None

    def eta_s(self) -> float | None:
        """Seconds until the last step, from the mean step time so far."""
        ev, sps = self.last, self.seconds_per_step()
        if ev is None or sps is None:
            return None
        return max(0, ev.total_steps - ev.step) * sps

    def stall_share(self) -> float | None:
        """The share of the last step spent waiting on I/O (``stall_s / step_s``)."""
        ev = self.last
        if ev is None or ev.step_s <= 0:
            return None
        return min(1.0, max(0.0, ev.stall_s / ev.step_s))

    def mean_tokens_per_s(self) -> float | None:
        return self._tps_sum / self._tps_n if self._tps_n else None

    def task_before_after(self) -> tuple[TaskEvalEvent | None, TaskEvalEvent | None]:
        """The task scored before training (step 0) and the last scoring after it."""
        before = next((t for t in self.task_evals if t.step == 0), None)
        after = next((t for t in reversed(self.task_evals) if t.step > 0), None)
        return before, after

    def preference_before_after(self) -> tuple[PreferenceEvalEvent | None, PreferenceEvalEvent | None]:
        """The held-out pairs scored before training (step 0) and the last scoring after it."""
        before = next((p for p in self.preference_evals if p.step == 0), None)
        after = next((p for p in reversed(self.preference_evals) if p.step > 0), None)
        return before, after

    def reward_before_after(self) -> tuple[RewardEvalEvent | None, RewardEvalEvent | None]:
        """GRPO's held-out reward before training (step 0) and the last one after it."""
        before = next((r for r in self.reward_evals if r.step == 0), None)
        after = next((r for r in reversed(self.reward_evals) if r.step > 0), None)
        return before, after

    def base_eval_loss(self) -> float | None:
        """The eval before training (step 0), if one was reported."""
        for step, loss in self.evals:
            if step == 0:
                return loss
        return None
