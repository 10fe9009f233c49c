"""Experiment trackers (``report_to=tensorboard,wandb,mlflow``): the run's metrics, through their own libraries.

Each tracker receives the events the run already emits (``events.py``) and logs the same
numbers ``metrics.jsonl`` holds — train loss, learning rate, tokens/s, step and stall time,
gradient norm, RSS and device memory, every tier's bytes and bandwidth, eval loss and
perplexity — under one set of names (:func:`event_metrics`), at the run's step:

* ``tensorboard`` — ``torch.utils.tensorboard.SummaryWriter`` into ``OUTPUT/tensorboard``;
* ``wandb`` — ``wandb.init`` in offline mode (``WANDB_MODE`` overrides) under ``OUTPUT/wandb``
  (``wandb sync`` uploads it later);
* ``mlflow`` — an ``MlflowClient`` on ``MLFLOW_TRACKING_URI``, else a local file store in
  ``OUTPUT/mlruns`` (``mlflow ui --backend-store-uri OUTPUT/mlruns``).

The libraries are imported when the run starts, never at outcore's import; a missing one
is a one-line :class:`~outcore.errors.ConfigError` naming the pip package, raised when the
sink is built, before any training.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError
from ..events import EvalEvent, RunFinished, RunStarted, StepEvent, TierStats
from ..training.config import TRACKERS

#: each tracker's module, and the pip package that provides it (the lightest that works)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}


def event_metrics(event: Any) -> tuple[int, dict[str, float]] | None:
    """The numbers an event carries, by tracker name, and the step they belong to.

    Args:
        event: any run event.

    Returns:
        ``(step, {name: value})`` for a StepEvent or an EvalEvent, else None.
    """
    if isinstance(event, EvalEvent):
        return event.step, {"eval/loss": event.eval_loss, "eval/perplexity": event.perplexity}
    if not isinstance(event, StepEvent):
        return None
    m = {"train/loss": event.loss, "train/lr": event.lr, "train/tokens_per_s": event.tokens_per_s,
         "train/step_s": event.step_s, "train/stall_s": event.stall_s, "memory/rss_bytes": event.rss_bytes}
    optional = {"train/grad_norm": event.grad_norm, "memory/device_bytes": event.device_bytes}
    m.update({k: v for k, v in optional.items() if v is not None})
    for tier, stats in event.tiers.items():
        m.update({f"tiers/{tier}/{f.name}": getattr(stats, f.name) for f in fields(TierStats)})
    return event.step, {k: float(v) for k, v in m.items()}


class _Tracker(Protocol):
    """One tracker: ``start`` at RunStarted, ``log`` per metrics-bearing event, ``finish`` at the end."""

    def start(self, started: RunStarted) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self) -> None: ...


class TensorBoardTracker:
    def start(self, started: RunStarted) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(started.output_dir) / "tensorboard"))
        self.writer.add_text("config", f"```\n{json.dumps(started.config, indent=1, default=str)}\n```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def finish(self) -> None:
        self.writer.close()


class WandbTracker:
    def start(self, started: RunStarted) -> None:
        import wandb

        self.run = wandb.init(project="outcore", name=started.run_name, dir=started.output_dir,
                              config=started.config, mode=os.environ.get("WANDB_MODE") or "offline")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    def start(self, started: RunStarted) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps the file store in maintenance mode behind this opt-out; it is the one
            # backend mlflow-skinny writes without a server or a database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(started.output_dir).resolve() / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("outcore")
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment("outcore")
        self.run_id = self.client.create_run(exp_id, run_name=started.run_name).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in started.config.items()]  # MLflow's value limit
        self.client.log_batch(self.run_id, params=params)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The run's trackers, fed every event by the sink (``tui/sinks.py``).

    Args:
        names: any of ``training.config.TRACKERS``.

    Raises:
        ConfigError: an unknown name, or a tracker whose library is not installed.
    """

    def __init__(self, names: list[str] | tuple[str, ...] = ()):
        for name in names:
            if name not in TRACKERS:
                raise ConfigError(f"report_to={name!r} is not one of: {', '.join(TRACKERS)}")
            module, package = PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"report_to={name} needs the {package!r} package; run `pip install {package}`")
        self.trackers: list[_Tracker] = [_CLASSES[name]() for name in dict.fromkeys(names)]
        self._started = False

    def emit(self, event: Any) -> None:
        """Start the trackers at RunStarted, log what each event carries, finish at RunFinished."""
        if isinstance(event, RunStarted) and not self._started:
            for t in self.trackers:
                t.start(event)
            self._started = True
            return
        logged = event_metrics(event)
        if logged is not None and self._started:
            for t in self.trackers:
                t.log(*logged)
        if isinstance(event, RunFinished):
            self.close()

    def close(self) -> None:
        """Finish every started tracker (idempotent)."""
        if self._started:
            self._started = False
            for t in self.trackers:
                t.finish()
