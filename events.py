"""Events the trainers emit and the UIs render.

Plain dataclasses with no torch import: ``tui/`` renders these without ever
touching a tensor (docs/architecture.md §1, §11). Trainers build them only at
log intervals, because filling ``loss`` costs a host sync (``.item()``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass
class TierStats:
    """Occupancy and traffic of one memory tier (DEVICE, HOST or NVME)."""

    held_bytes: int = 0  # bytes resident in the tier now
    budget_bytes: int = 0  # the tier's budget (0 = unbounded / not managed)
    read_bytes: int = 0  # bytes read from the tier since the run started
    written_bytes: int = 0  # bytes written into the tier since the run started
    read_gbps: float = 0.0  # bandwidth over the last step
    write_gbps: float = 0.0


@dataclass
class RankStats:
    """One rank's share of a step under torchrun (rank 0's StepEvent carries every rank's)."""

    rank: int
    step_s: float  # wall seconds of this rank's step
    stall_s: float  # time this rank's compute waited on I/O during the step
    rss_bytes: int
    tiers: dict[str, TierStats] = field(default_factory=dict)  # this rank's tiers, by name


@dataclass
class RunStarted:
    """Sent once before the first step."""

    run_name: str
    model: str
    n_params: int
    n_trainable: int
    total_steps: int
    output_dir: str
    method: str = "full"
    optim: str = "adamw"
    plan_table: str | None = None  # the MemoryPlan table, when there is one
    config: dict[str, Any] = field(default_factory=dict)
    tokens_per_step: int = 0  # the tokens one optimizer step trains on, over every rank (0: unknown)
    #: where the saved activations live (activations.policy.activation_home: "block checkpoints
    #: NVME (recompute_nvme)"); "": nothing is saved for a backward (zeroth order) or unknown
    activations: str = ""


@dataclass
class StepEvent:
    """One optimizer step (sent every ``log_every`` steps)."""

    step: int  # 1-based index of the step just finished
    total_steps: int
    loss: float
    lr: float
    tokens_per_s: float
    step_s: float  # wall seconds of this step
    elapsed_s: float  # wall seconds since the first step started
    rss_bytes: int  # process RSS now
    ram_bytes: int = 0  # total RAM of the machine
    grad_norm: float | None = None
    device_bytes: int | None = None  # CUDA memory allocated, when on CUDA
    device_total_bytes: int | None = None
    eval_loss: float | None = None  # set on steps where an eval ran
    stall_s: float = 0.0  # time compute waited on I/O during this step
    tiers: dict[str, TierStats] = field(default_factory=dict)  # by tier name
    ranks: list[RankStats] = field(default_factory=list)  # under torchrun: every rank's, in rank order
    # SSD wear (training/wear.py; None when not measured): bytes this run wrote to its swap disk
    ssd_written_bytes: int | None = None  # since the run started, its setup included
    ssd_written_per_step_bytes: float | None = None  # per step, since the previous logged step
    ssd_life_used_pct: float | None = None  # with ssd_tbw: % of the drive's rated writes used so far
    ssd_life_per_1000_steps_pct: float | None = None  # with ssd_tbw: % 1000 steps like these use

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the metrics.jsonl row; ``ranks`` only when there are several)."""
        row = asdict(self)
        if not self.ranks:
            del row["ranks"]
        return row


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)``, exact wherever a float holds it; ``inf`` past that and for a NaN loss.

    No lower cap: any finite cap below the float's range (``exp(50)`` once) would report a
    made-up number for every loss above it. ``exp`` overflows a double past a loss of ~709.78,
    and there the perplexity saturates at ``inf`` instead of raising; None means no loss.
    """
    if loss is None:
        return None
    if math.isnan(loss):
        return math.inf
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass
class EvalEvent:
    """A validation pass finished."""

    step: int  # 0 = before training
    eval_loss: float
    perplexity: float  # perplexity(eval_loss)


@dataclass
class TaskEvalEvent:
    """A labelled task was scored (with each validation pass when ``eval_task`` is set)."""

    step: int  # 0 = before training
    task: str  # the task's name (its file's stem)
    n: int  # examples scored
    acc: float  # share answered right (highest log-likelihood choice)
    acc_norm: float  # the same with log-likelihood per character of the choice

    def to_row(self) -> dict[str, float]:
        """The metrics.jsonl fields of this event."""
        return {"task_acc": self.acc, "task_acc_norm": self.acc_norm}


@dataclass
class PreferenceEvalEvent:
    """The held-out preference pairs were scored (each validation pass of a preference objective)."""

    step: int  # 0 = before training
    n: int  # pairs scored (KTO: examples)
    # share of pairs whose chosen completion the objective rewards above the rejected one (KTO: of
    # examples whose reward has their label's sign: > 0 for a desirable completion, < 0 else)
    accuracy: float
    # mean reward of the chosen completion minus the rejected one's (KTO: of the desirable
    # examples minus the undesirable ones')
    margin: float
    kl: float | None = None  # KTO: the mean of its batches' KL estimates (None: a paired objective)

    @property
    def unit(self) -> str:
        """What ``n`` counts: ``pairs``, or (KTO) ``examples``."""
        return "pairs" if self.kl is None else "examples"

    def to_row(self) -> dict[str, float]:
        """The metrics.jsonl fields of this event."""
        row = {"pref_accuracy": self.accuracy, "pref_margin": self.margin}
        return row if self.kl is None else {**row, "pref_kl": self.kl}


@dataclass
class GRPOStepEvent:
    """A GRPO step's rollouts: sent after its StepEvent at each logged step."""

    step: int
    reward: float  # mean reward of the step's sampled completions (the weighted sum of the reward functions)
    reward_std: float  # its standard deviation over them
    kl: float  # mean per-token KL to the reference (k3 estimator; 0 without a KL term)
    completion_length: float  # mean tokens per completion
    generate_s: float  # seconds sampling and scoring the completions (and the reference's pass)
    train_s: float  # seconds of the forward, backward and update

    def to_row(self) -> dict[str, float]:
        """The metrics.jsonl fields of this event."""
        return {"reward": self.reward, "reward_std": self.reward_std, "kl": self.kl,
                "completion_length": self.completion_length, "generate_s": self.generate_s, "train_s": self.train_s}


@dataclass
class RewardEvalEvent:
    """The held-out prompts were completed (greedily) and rewarded (each validation pass of GRPO)."""

    step: int  # 0 = before training
    n: int  # prompts completed
    reward: float  # mean reward
    reward_std: float  # its standard deviation
    completion_length: float  # mean tokens per completion

    def to_row(self) -> dict[str, float]:
        """The metrics.jsonl fields of this event."""
        return {"eval_reward": self.reward, "eval_reward_std": self.reward_std}


@dataclass
class RunFinished:
    """Sent once after the last step (also after an interrupt)."""

    steps_done: int
    wall_s: float
    peak_rss_bytes: int
    output_dir: str
    base_eval_loss: float | None = None
    final_eval_loss: float | None = None
    interrupted: bool = False
    final_dir: str | None = None
    ssd_written_bytes: int | None = None  # as StepEvent's, at the end (final checkpoint and export included)
    ssd_life_used_pct: float | None = None
    ssd_life_per_1000_steps_pct: float | None = None  # the last StepEvent's projection


Event = (RunStarted | StepEvent | EvalEvent | TaskEvalEvent | PreferenceEvalEvent | GRPOStepEvent | RewardEvalEvent
         | RunFinished)


class EventSink(Protocol):
    """Anything that consumes events: the dashboard, plain logs, JSONL files."""

    def emit(self, event: Event) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """A sink that drops every event (a recipe run from Python without a UI)."""

    def emit(self, event: Event) -> None:
        pass

    def close(self) -> None:
        pass
