"""The live terminal dashboard (rich): progress, loss, speed, memory, SSD writes and the memory tiers.

Threading: ``emit`` runs on the trainer's thread and only folds the event into a
``RunState`` under a lock (microseconds). Drawing happens on rich ``Live``'s own
refresh thread, a few times per second, which calls :meth:`Dashboard.render`;
``render`` copies what it needs under the same lock and builds the renderables
outside it, so the trainer never waits on terminal I/O.

rich is imported when a Dashboard is built, never at ``outcore.tui`` import.
"""
from __future__ import annotations

import atexit
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from ..events import (EvalEvent, GRPOStepEvent, PreferenceEvalEvent, RewardEvalEvent, RunFinished, RunStarted,
                      StepEvent, TaskEvalEvent)
from .format import (fmt_bytes, fmt_count, fmt_duration, fmt_float, fmt_gbps, fmt_lr,
                     fmt_percent, fmt_seconds, perplexity, sparkline)
from .state import RunState, TierView
from .summary import RunSummary, summary_panel, wear_text

REFRESH_PER_SECOND = 4.0  # enough to look live, little enough to cost nothing
MAX_WIDTH = 112  # both panels share one width, capped so a wide terminal does not stretch them
SPARK_WIDTH = 36


@dataclass
class _Snapshot:
    """Plain values copied out of the RunState under the lock (no rich objects)."""

    started: RunStarted | None
    last: StepEvent | None
    finished: RunFinished | None
    losses: list[float]
    eval_losses: list[float]
    last_eval: tuple[int, float] | None
    task: tuple[TaskEvalEvent | None, TaskEvalEvent | None]  # the eval task before training, and the latest
    preference: tuple[PreferenceEvalEvent | None, PreferenceEvalEvent | None]  # the held-out pairs, likewise
    eta_s: float | None
    stall: float | None
    rollouts: GRPOStepEvent | None = None  # GRPO: the last logged step's completions
    reward: tuple[RewardEvalEvent | None, RewardEvalEvent | None] = (None, None)  # GRPO's held-out reward
    tiers: list[TierView] = field(default_factory=list)


def _ratio_style(ratio: float) -> str:
    return "green" if ratio < 0.7 else ("yellow" if ratio < 0.9 else "red")


class Dashboard:
    """A rich Live view of a run; an EventSink view (``emit``, ``show_summary``, ``close``).

    Args:
        console: the rich Console to draw on (default: a Console on stdout).
        refresh_per_second: redraws per second (at most; a redraw also follows RunFinished).
        live: False draws nothing live (``render`` still works): for tests and for
            consoles that are not terminals.
    """

    def __init__(self, console: Any = None, refresh_per_second: float = REFRESH_PER_SECOND,
                 live: bool = True) -> None:
        from rich.console import Console

        if not 0 < refresh_per_second <= 30:
            raise ValueError(f"refresh_per_second={refresh_per_second!r} must be in (0, 30]")
        self.console = console if console is not None else Console()
        self._refresh = refresh_per_second
        self._use_live = live
        self._lock = threading.Lock()
        self.state = RunState()
        self._live: Any = None
        self._closed = False

    # ---- EventSink ------------------------------------------------------------
    def emit(self, event: Any) -> None:
        """Fold one event in; start the live view on the first event, stop it at RunFinished."""
        if self._closed:
            return
        with self._lock:
            self.state.update(event)
        if isinstance(event, RunStarted):
            self.console.print(self._header_text(event))
            if event.plan_table:
                self.console.print(event.plan_table.rstrip("\n"), highlight=False, markup=False)
        if isinstance(event, (RunStarted, StepEvent, EvalEvent)) and self._live is None:
            self._start()
        elif isinstance(event, RunFinished):
            self._stop()

    def show_summary(self, summary: RunSummary) -> None:
        """Print the end-of-run summary panel below the (stopped) dashboard."""
        if not self._closed:
            self._stop()
            self.console.print(summary_panel(summary))

    def close(self) -> None:
        """Stop the live view and restore the terminal (idempotent)."""
        if not self._closed:
            self._stop()
            self._closed = True

    # ---- live management --------------------------------------------------------
    def _start(self) -> None:
        if not self._use_live:
            return
        from rich.live import Live

        # Route stray prints (library warnings, the trainer's own prints) above the live
        # view, but only when it owns the real terminal; never hijack a test's stdout.
        redirect = self.console.is_terminal and self.console.file in (sys.stdout, sys.__stdout__)
        self._live = Live(get_renderable=self.render, console=self.console,
                          refresh_per_second=self._refresh, transient=False,
                          redirect_stdout=redirect, redirect_stderr=redirect)
        self._live.start()
        # A run killed by an exception that never reaches close() must still give the
        # terminal its cursor back.
        atexit.register(self.close)

    def _stop(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()  # joins the refresh thread after one final draw
            atexit.unregister(self.close)

    # ---- rendering ----------------------------------------------------------------
    def _snapshot(self) -> _Snapshot:
        with self._lock:  # held only to copy plain values; the trainer waits microseconds at most
            s = self.state
            return _Snapshot(started=s.started, last=s.last, finished=s.finished,
                             losses=list(s.losses), eval_losses=list(s.eval_losses),
                             last_eval=s.last_eval, task=s.task_before_after(), preference=s.preference_before_after(),
                             eta_s=s.eta_s(),
                             stall=s.stall_share(), rollouts=s.rollouts, reward=s.reward_before_after(),
                             tiers=list(s.tiers.values()))

    def render(self) -> Any:
        """The whole dashboard as one rich renderable (called by Live a few times per second)."""
        from rich.console import Group

        snap = self._snapshot()
        parts = [self._main_panel(snap)]
        if snap.tiers:
            parts.append(self._tier_panel(snap))
        if snap.last is not None and len(snap.last.ranks) > 1:  # under torchrun: every rank's row
            from .rank_panel import rank_panel

            parts.append(rank_panel(snap.last.ranks, self._width()))
        return Group(*parts)

    @staticmethod
    def _header_text(ev: RunStarted) -> Any:
        from rich.text import Text

        dot = (" · ", "dim")
        return Text.assemble(("outcore ", "bold magenta"), (ev.run_name, "bold"), dot,
                             (ev.model, "cyan"), dot, (f"{ev.method}/{ev.optim}", "green"), dot,
                             (_params(ev.n_params, ev.n_trainable), "dim"), dot,
                             (f"{ev.total_steps} steps", ""), ("  -> ", "dim"), (ev.output_dir, "underline"))

    def _memory_row(self, ev: Any) -> Any:
        """RSS against the machine's RAM and, on a GPU, the device memory in use: bars and bytes."""
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        mem = Table.grid(padding=(0, 1))
        width = self._width()
        bar = 16 if width >= MAX_WIDTH else 6
        cells: list[Any] = []
        if ev.ram_bytes:
            ratio = ev.rss_bytes / ev.ram_bytes
            cells += [Text("RSS", style="dim"),
                      ProgressBar(total=1.0, completed=min(ratio, 1.0), width=bar,
                                  complete_style=_ratio_style(ratio)),
                      Text(f"{fmt_bytes(ev.rss_bytes)} / {fmt_bytes(ev.ram_bytes)}"
                           + (" RAM" if width >= MAX_WIDTH else "")
                           + (f"  ({fmt_percent(ratio)})" if width >= 90 else ""))]
        else:
            cells += [Text("RSS", style="dim"), Text(fmt_bytes(ev.rss_bytes))]
        if ev.device_bytes is not None:
            cells.append(Text("   device", style="dim"))
            if ev.device_total_bytes:
                ratio = ev.device_bytes / ev.device_total_bytes
                cells += [ProgressBar(total=1.0, completed=min(ratio, 1.0), width=bar,
                                      complete_style=_ratio_style(ratio)),
                          Text(f"{fmt_bytes(ev.device_bytes)} / {fmt_bytes(ev.device_total_bytes)}")]
            else:
                cells.append(Text(fmt_bytes(ev.device_bytes)))
        mem.add_row(*cells)
        return mem

    def _main_panel(self, snap: _Snapshot) -> Any:
        from rich import box
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        ev = snap.last
        grid = Table.grid(padding=(0, 2), expand=False)
        grid.add_column(style="bold cyan", no_wrap=True, min_width=7)
        grid.add_column(no_wrap=True)
        total = ev.total_steps if ev is not None else (snap.started.total_steps if snap.started else 0)
        step = ev.step if ev is not None else 0

        # progress
        row = Table.grid(padding=(0, 2))
        row.add_row(Text(f"{step}/{total}", style="bold"),
                    ProgressBar(total=max(total, 1), completed=step,
                                width=max(10, min(44, self._width() - 66))),
                    Text(fmt_percent(step / total if total else 0.0)),
                    Text.assemble(("elapsed ", "dim"), fmt_duration(ev.elapsed_s if ev else None),
                                  ("  ETA ", "dim"), (fmt_duration(snap.eta_s), "bold")))
        grid.add_row("step", row)
        if snap.last_eval is not None:
            estep, eloss = snap.last_eval
            ev_text = Text.assemble(("eval ", "dim"), (fmt_float(eloss), "bold"),
                                    (f"  ppl {fmt_float(perplexity(eloss), 2)}", ""),
                                    (f"  @{estep}  ", "dim"), (sparkline(snap.eval_losses, 16), "red"))
        else:
            ev_text = Text("eval -", style="dim")
        if ev is None:
            loss = Text("waiting for the first step...", style="dim italic")
        else:
            loss = Text.assemble((fmt_float(ev.loss), "bold"), "  ",
                                 (sparkline(snap.losses, SPARK_WIDTH), "blue"))
        pair = Table.grid(padding=(0, 4))
        pair.add_row(loss, ev_text)
        grid.add_row("loss", pair)
        if snap.task[0] is not None or snap.task[1] is not None:
            grid.add_row("task", _task_text(*snap.task))
        if snap.preference[0] is not None or snap.preference[1] is not None:
            label = "pairs" if (snap.preference[1] or snap.preference[0]).kl is None else "rewards"  # (KTO)
            grid.add_row(label, _preference_text(*snap.preference))
        if snap.rollouts is not None:
            grid.add_row("rollout", _rollouts_text(snap.rollouts))
        if snap.reward[0] is not None or snap.reward[1] is not None:
            grid.add_row("reward", _reward_text(*snap.reward))
        if snap.started is not None and (snap.started.tokens_per_step or snap.started.activations):
            grid.add_row("context", _context_text(snap.started))
        if ev is not None:
            speed = Text.assemble((fmt_count(ev.tokens_per_s), "bold"), " tokens/s   ",
                                  (fmt_seconds(ev.step_s), "bold"), "/step   ",
                                  ("lr ", "dim"), fmt_lr(ev.lr))
            if ev.grad_norm is not None:  # zeroth-order runs have no gradient
                speed.append_text(Text.assemble("   ", ("grad norm ", "dim"), fmt_float(ev.grad_norm, 3)))
            grid.add_row("speed", speed)
            grid.add_row("memory", self._memory_row(ev))
            wear = wear_text(ev.ssd_written_bytes, ev.ssd_written_per_step_bytes, ev.ssd_life_used_pct,
                             ev.ssd_life_per_1000_steps_pct)
            if wear:  # SSD wear: what this run wrote to its swap disk (training/wear.py)
                grid.add_row("ssd", Text(wear))

        title, style = self._title(snap)
        return Panel(grid, title=title, title_align="left", box=box.ROUNDED, border_style=style,
                     width=self._width(), padding=(0, 1))

    def _width(self) -> int:
        return min(self.console.width, MAX_WIDTH)

    @staticmethod
    def _title(snap: _Snapshot) -> tuple[str, str]:
        name = f" {snap.started.run_name}" if snap.started else ""
        if snap.finished is not None:
            if snap.finished.interrupted:
                return f"[bold]outcore{name}[/] · [yellow]interrupted[/]", "yellow"
            return f"[bold]outcore{name}[/] · [green]finished[/]", "green"
        return f"[bold]outcore{name}[/] · [cyan]training[/]", "cyan"

    def _tier_panel(self, snap: _Snapshot) -> Any:
        from rich import box
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        wide = self._width() >= MAX_WIDTH
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), expand=wide, show_edge=False,
                      pad_edge=False, collapse_padding=not wide)
        table.add_column("tier", style="bold", no_wrap=True)
        table.add_column("held / budget", no_wrap=True)
        headers = (("read", "write", "read/step", "written/step", "written") if wide else
                   ("rd GB/s", "wr GB/s", "rd/step", "wr/step", "written"))
        for name in headers:
            table.add_column(name, justify="right", no_wrap=True)
        gbps = fmt_gbps if wide else (lambda x: "-" if x is None else f"{x:.2f}")
        for tv in sorted(snap.tiers, key=lambda t: _TIER_ORDER.get(t.name.upper(), 9)):
            st = tv.stats
            budget = fmt_bytes(st.budget_bytes) if st.budget_bytes > 0 else ("unbounded" if wide else "∞")
            if st.budget_bytes > 0 and wide:
                ratio = st.held_bytes / st.budget_bytes
                held: Any = Table.grid(padding=(0, 1))
                held.add_row(ProgressBar(total=1.0, completed=min(ratio, 1.0), width=12,
                                         complete_style=_ratio_style(ratio)),
                             Text(f"{fmt_bytes(st.held_bytes)} / {budget}"))
            else:
                held = Text(f"{fmt_bytes(st.held_bytes)} / {budget}")
            table.add_row(tv.name, held, gbps(st.read_gbps), gbps(st.write_gbps),
                          fmt_bytes(tv.read_per_step), fmt_bytes(tv.written_per_step),
                          fmt_bytes(st.written_bytes))
        stall = snap.stall
        if stall is None:
            title = "[bold]tiers[/]"
        else:
            color = "green" if stall < 0.1 else ("yellow" if stall < 0.3 else "red")
            title = f"[bold]tiers[/] · I/O stall [{color}]{fmt_percent(stall)}[/] of the step"
        return Panel(table, title=title, title_align="left", box=box.ROUNDED, border_style="blue",
                     width=self._width(), padding=(0, 1))


_TIER_ORDER = {"DEVICE": 0, "HOST": 1, "NVME": 2}


def _params(n_params: int, n_trainable: int) -> str:
    if n_trainable == n_params:
        return f"{n_params / 1e6:,.1f}M params, all trainable"
    return f"{n_params / 1e6:,.1f}M params, {n_trainable / 1e6:,.1f}M trainable"


def _preference_text(before: PreferenceEvalEvent | None, latest: PreferenceEvalEvent | None) -> Any:
    """``accuracy 0.0% -> 75.0%  margin +0.0000 -> +0.4210  @40``: before training, then latest
    (KTO adds the latest KL estimate, ``KL 0.0123``: before training the policy is the reference)."""
    from rich.text import Text

    text = Text()
    for name, fmt in (("accuracy", "{:.1%}"), ("margin", "{:+.4f}")):
        values = [fmt.format(getattr(p, name)) for p in (before, latest) if p is not None]
        text.append_text(Text.assemble((f"{name} ", "dim"), (" -> ".join(values), "bold"), "  "))
    if (latest or before).kl is not None:
        text.append_text(Text.assemble(("KL ", "dim"), (f"{(latest or before).kl:.4f}", "bold"), "  "))
    if latest is not None:
        text.append(f"@{latest.step}", style="dim")
    return text


def _context_text(ev: RunStarted) -> Any:
    """``16,384 tokens/step   block checkpoints on NVME (recompute_nvme)``."""
    from rich.text import Text

    text = Text()
    if ev.tokens_per_step:
        text.append_text(Text.assemble((f"{ev.tokens_per_step:,}", "bold"), " tokens/step   "))
    return text.append(ev.activations)


def _rollouts_text(ev: GRPOStepEvent) -> Any:
    """``reward 0.4120 ± 0.2100  kl 0.0012  42 tok  gen 72% / train 28%``: the last logged step."""
    from rich.text import Text

    total = ev.generate_s + ev.train_s
    share = ev.generate_s / total if total > 0 else 0.0
    return Text.assemble(("reward ", "dim"), (f"{ev.reward:.4f} ± {ev.reward_std:.4f}", "bold"), "  ",
                         ("kl ", "dim"), f"{ev.kl:.4f}", "  ", f"{ev.completion_length:.0f}", (" tok  ", "dim"),
                         ("gen ", "dim"), f"{share:.0%}", (" / train ", "dim"), f"{1 - share:.0%}")


def _reward_text(before: RewardEvalEvent | None, latest: RewardEvalEvent | None) -> Any:
    """``held-out 0.1250 -> 0.5625  @40``: the held-out prompts' mean reward before training, then latest."""
    from rich.text import Text

    values = [f"{r.reward:.4f}" for r in (before, latest) if r is not None]
    text = Text.assemble(("held-out ", "dim"), (" -> ".join(values), "bold"), "  ")
    if latest is not None:
        text.append(f"@{latest.step}", style="dim")
    return text


def _task_text(before: TaskEvalEvent | None, latest: TaskEvalEvent | None) -> Any:
    """``shakespeare_mc  acc 17.5% -> 30.0% @40  acc_norm 22.5% -> 35.0%``: before training, then latest."""
    from rich.text import Text

    first = before or latest
    text = Text.assemble((first.task, "bold"), "  ")
    for name, key in (("acc", "acc"), ("acc_norm", "acc_norm")):
        values = [f"{getattr(t, key):.1%}" for t in (before, latest) if t is not None]
        text.append_text(Text.assemble((f"{name} ", "dim"), (" -> ".join(values), "bold"), "  "))
    if latest is not None:
        text.append(f"@{latest.step}", style="dim")
    return text
