"""The public Python API: ``outcore.finetune``, one call from a config to a trained model, and
``outcore.evaluate``, its perplexity and task accuracy.

It sits above the recipes: it resolves the config, builds the run's event sink (the
dashboard or plain log, ``OUTPUT/metrics.jsonl`` and the ``report_to`` trackers; recipes
never import ``tui``), runs the recipe that ``methods.METHODS`` names for ``config.method``
and, with ``push_to_hub``, uploads the export. ``outcore finetune`` calls it too. Under
``torchrun`` (or Ray Train) every rank calls it: rank 0 gets the view, the others their
``metrics.rankR.jsonl`` only (``training/distributed/across_ranks.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from .events import EventSink
    from .training.config import FinetuneConfig
    from .training.lifecycle import Recipe, Run
    from .recipes.evaluate import EvalReport
    from .training.runs import FinetuneResult


def finetune(config: FinetuneConfig | None = None, sink: EventSink | None = None, **overrides: Any
             ) -> FinetuneResult:
    """Fine-tune as ``config`` says (defaults: the embedded model on the embedded data).

    Args:
        config: the run's config; None means ``FinetuneConfig()``.
        sink: where events go (default: the dashboard or plain log as ``config.ui`` says,
            plus OUTPUT/metrics.jsonl, OUTPUT/loss_curve.png and the ``config.report_to`` trackers).
        **overrides: config fields to change, e.g. ``finetune(max_steps=10, lr=1e-4)``.

    Returns:
        A FinetuneResult (output dir, steps, eval losses, final export dir).

    Raises:
        OutcoreError: bad config, model, data or checkpoint (one-line message); a failed
            ``push_to_hub`` upload (``training.hub.HubError``, raised after the run, its outputs kept).
    """
    from .training.config import load_config

    config = load_config(overrides={**(config.to_dict() if config else {}), **overrides})
    own_sink = sink is None
    if own_sink:
        from .tui import make_sink

        # The sink writes nothing before the run's first event, and the run creates
        # (or checks, for a resume) the output directory before it sends one.
        from .offload.distributed import from_env

        # under torchrun rank 0 shows the run; the others write their metrics file only
        sink = make_sink(config.ui, config.output, report_to=config.report_to, rank=from_env().rank)
    try:
        from .training.lifecycle import Run

        result = Run(config, sink).execute(_recipe_class(config.method, config.objective))
    finally:
        if own_sink:
            sink.close()  # also when the recipe failed before it could (idempotent)
    if config.push_to_hub and result.final_dir is not None:
        from .training.hub import push_to_hub

        push_to_hub(result.final_dir, config.push_to_hub)
    return result


def _recipe_class(method: str, objective: str) -> Callable[[Run], Recipe]:
    """The recipe class that runs ``objective`` with ``method`` (``methods.OBJECTIVES``, else
    ``methods.METHODS``), imported now."""
    import importlib

    from .methods import recipe_of

    module, cls = recipe_of(method, objective).split(":")
    return getattr(importlib.import_module(module, __package__), cls)


def evaluate(model: str = "default", *, data: str | None = None, task: str | None = None, **overrides: Any
             ) -> EvalReport:
    """Held-out perplexity and task accuracy of a model, or of a run's result (``outcore eval``).

    Args:
        model: a model spec (as ``finetune``'s ``model``) or a run's output directory
            (its ``final/`` model on the run's own data, split and ``eval_task``).
        data: text data for the held-out perplexity (default: the run's data, else
            ``"default"``; with only a ``task`` given for a model, no perplexity).
        task: a labelled JSONL task file, or ``"shakespeare"`` (see ``outcore.data.tasks``).
        **overrides: config keys: ``seq_len``, ``batch_size``, ``eval_batches``, ``seed``,
            ``val_fraction``, ``dtype``, ``offload`` (none | cpu | nvme), ``swap_dir`` ...

    Returns:
        An EvalReport (``eval_loss``, ``perplexity``, ``task.acc`` / ``task.acc_norm``; ``to_dict()``).

    Raises:
        OutcoreError: bad model, run, data, task file or option (one-line message).
    """
    from pathlib import Path

    from .recipes.evaluate import evaluate_model, evaluation_config

    cfg = evaluation_config(model, data=data, eval_task=task, **overrides)
    is_run = (Path(model) / "config.yaml").is_file()
    return evaluate_model(cfg, perplexity=data is not None or is_run or not cfg.eval_task)
