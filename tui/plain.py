"""Plain log lines: one line per StepEvent and EvalEvent, for CI, pipes and notebooks.

Lines go through ``tqdm.write`` so they print cleanly above any tqdm bar that
shares the stream (a data-loading bar, a notebook progress widget), and each is
flushed at once so ``tail -f`` and CI logs show progress as it happens.
"""
from __future__ import annotations

import sys
from typing import IO, Any

from ..methods import GRPO
from ..events import (EvalEvent, GRPOStepEvent, PreferenceEvalEvent, RewardEvalEvent, RunFinished, RunStarted,
                      StepEvent, TaskEvalEvent)
from .format import (fmt_bytes, fmt_count, fmt_duration, fmt_float, fmt_gbps, fmt_lr,
                     fmt_percent, fmt_seconds, perplexity)
from .state import RunState, as_tier_stats
from .summary import RunSummary, summary_lines, wear_text


def started_line(ev: RunStarted) -> str:
    """``outcore: run NAME | model M (135.0M params, 135.0M trainable) | full/adamw | 40 steps |
    512 tokens/step | activations: block checkpoints on NVME (recompute_nvme) -> DIR`` (the last two
    when known)."""
    params = f"{ev.n_params / 1e6:,.1f}M params, {ev.n_trainable / 1e6:,.1f}M trainable"
    context = f" | {ev.tokens_per_step:,} tokens/step" if ev.tokens_per_step else ""
    context += f" | activations: {ev.activations}" if ev.activations else ""
    return (f"outcore: run {ev.run_name} | model {ev.model} ({params}) | {ev.method}/{ev.optim} | "
            f"{ev.total_steps} steps{context} -> {ev.output_dir}")


def step_line(ev: StepEvent, state: RunState | None = None) -> str:
    """One log line for a step, e.g.
    ``step 12/40 | loss 2.3456 | lr 4.50e-05 | 1,234 tok/s | 0.42 s/step | rss 3.4 GiB | eta 0:12``.

    Args:
        ev: the step.
        state: the folded run state (for the ETA); None leaves the ETA out.

    Returns:
        The line, without a newline. Tier traffic and the I/O stall share are appended
        when the event carries tiers, and the bytes written to the swap disk when measured.
    """
    width = len(str(ev.total_steps))
    parts = [f"step {ev.step:>{width}}/{ev.total_steps}", f"loss {fmt_float(ev.loss)}"]
    if ev.eval_loss is not None:
        parts.append(f"eval {fmt_float(ev.eval_loss)}")
    parts.append(f"lr {fmt_lr(ev.lr)}")
    if ev.grad_norm is not None:
        parts.append(f"gnorm {fmt_float(ev.grad_norm, 3)}")
    parts.append(f"{fmt_count(ev.tokens_per_s)} tok/s")
    parts.append(f"{fmt_seconds(ev.step_s)}/step")
    parts.append(f"rss {fmt_bytes(ev.rss_bytes)}")
    if ev.device_bytes is not None:
        parts.append(f"dev {fmt_bytes(ev.device_bytes)}")
    for name, t in sorted(ev.tiers.items()):
        stats = as_tier_stats(t)
        parts.append(f"{name.lower()} {fmt_bytes(stats.held_bytes)} r {fmt_gbps(stats.read_gbps)} "
                     f"w {fmt_gbps(stats.write_gbps)}")
    if ev.tiers and ev.step_s > 0:
        parts.append(f"stall {fmt_percent(min(1.0, ev.stall_s / ev.step_s))}")
    wear = wear_text(ev.ssd_written_bytes, ev.ssd_written_per_step_bytes, ev.ssd_life_used_pct,
                     ev.ssd_life_per_1000_steps_pct)
    if wear:
        parts.append(f"ssd {wear}")
    if state is not None:
        parts.append(f"eta {fmt_duration(state.eta_s())}")
    return " | ".join(parts)


def eval_line(ev: EvalEvent) -> str:
    """``eval @ step 20: loss 2.4011, perplexity 11.04``."""
    return f"eval @ step {ev.step}: loss {fmt_float(ev.eval_loss)}, perplexity {fmt_float(perplexity(ev.eval_loss), 2)}"


def task_line(ev: TaskEvalEvent) -> str:
    """``task shakespeare_mc @ step 0: acc 17.5% (7/40), acc_norm 22.5%``."""
    right = round(ev.acc * ev.n)
    return f"task {ev.task} @ step {ev.step}: acc {ev.acc:.1%} ({right}/{ev.n}), acc_norm {ev.acc_norm:.1%}"


def preference_line(ev: PreferenceEvalEvent) -> str:
    """``preference @ step 20: accuracy 62.5% of 16 pairs, margin +0.0312`` (KTO: ``of 16
    examples, margin +0.0312, KL 0.0040``)."""
    line = f"preference @ step {ev.step}: accuracy {ev.accuracy:.1%} of {ev.n} {ev.unit}, margin {ev.margin:+.4f}"
    return line if ev.kl is None else f"{line}, KL {ev.kl:.4f}"


def rollouts_line(ev: GRPOStepEvent) -> str:
    """``rollouts @ step 3: reward 0.4120 ± 0.2100, kl 0.0012, 42.0 tokens/completion, generate 3.1s, train 1.2s``."""
    return (f"rollouts @ step {ev.step}: reward {ev.reward:.4f} ± {ev.reward_std:.4f}, kl {ev.kl:.4f}, "
            f"{ev.completion_length:.1f} tokens/completion, generate {ev.generate_s:.1f}s, train {ev.train_s:.1f}s")


def reward_line(ev: RewardEvalEvent) -> str:
    """``held-out reward @ step 20: 0.5625 ± 0.4961 over 16 prompts (38.2 tokens/completion)``."""
    return (f"held-out reward @ step {ev.step}: {ev.reward:.4f} ± {ev.reward_std:.4f} over {ev.n} prompts "
            f"({ev.completion_length:.1f} tokens/completion)")


class PlainView:
    """An EventSink view that prints plain lines.

    Args:
        stream: where to write (default: ``sys.stdout`` at the time of each write).
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream
        self.state = RunState()
        self._closed = False

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        stream = self._stream if self._stream is not None else sys.stdout
        tqdm.write(line, file=stream)
        stream.flush()

    def emit(self, event: Any) -> None:
        """Fold the event into the state and print its line (RunFinished prints nothing:
        the summary follows through :meth:`show_summary`)."""
        if self._closed:
            return
        self.state.update(event)
        if isinstance(event, RunStarted):
            self._write(started_line(event))
            if event.plan_table:
                self._write(event.plan_table.rstrip("\n"))
        elif isinstance(event, StepEvent):
            self._write(step_line(event, self.state))
        elif isinstance(event, EvalEvent):
            config = self.state.started.config if self.state.started else None
            if not config or config.get("objective") != GRPO:  # (GRPO's is minus its reward line's)
                self._write(eval_line(event))
        elif isinstance(event, TaskEvalEvent):
            self._write(task_line(event))
        elif isinstance(event, PreferenceEvalEvent):
            self._write(preference_line(event))
        elif isinstance(event, GRPOStepEvent):
            self._write(rollouts_line(event))
        elif isinstance(event, RewardEvalEvent):
            self._write(reward_line(event))
        elif isinstance(event, RunFinished):
            pass

    def show_summary(self, summary: RunSummary) -> None:
        """Print the end-of-run summary."""
        if not self._closed:
            self._write("\n".join(summary_lines(summary)))

    def close(self) -> None:
        """Stop printing (idempotent)."""
        self._closed = True
