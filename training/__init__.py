"""outcore.training — the services every recipe uses: the run's config and output directory,
its lifecycle (``lifecycle.Run``, around every recipe), the trainer protocol, its checkpoints
(``checkpoint/``, DCP across ranks), a run as one of several ranks (``distributed/``, elastic
restarts), the training loss, what is built before the first step (adapters, optimizer, plan,
engine), SSD wear and run status.
Recipes (``outcore.recipes``) compose them; nothing here imports ``recipes`` or ``tui``.
"""
from .._exports import lazy_exports

# Lazy exports (PEP 562): ``import outcore.training`` stays free of torch until a name is used
# (the command line reads the config's choices without it).
_EXPORTS = {
    "FinetuneConfig": ".config", "load_config": ".config", "save_config": ".config", "METHODS": ".config",
    "OPTIMIZERS": ".config", "UI_MODES": ".config", "TRACKERS": ".config",
    "prepare_output_dir": ".output_dir", "holding_output_dir": ".output_dir",
    "StopOnSignal": ".signals", "lr_lambda": ".lifecycle",
    "set_threads": ".process", "rss_bytes": ".process", "peak_rss_bytes": ".process", "ram_total_bytes": ".process",
    "CausalLMScorer": ".loss", "mean_eval_loss": ".loss",
    "with_lora": ".build", "load_zo_model": ".build", "optimizer_for_config": ".build",
    "check_offload_supported": ".build", "plan_this_run": ".build", "offload_from_plan": ".build",
    "swap_dir_of": ".build",
    "InMemoryModel": ".in_memory", "Trainer": ".trainer",
    "Run": ".lifecycle", "Recipe": ".lifecycle", "Built": ".lifecycle", "Stepped": ".lifecycle",
    "Evaluation": ".lifecycle",
    "save_checkpoint": ".checkpoint.files", "load_checkpoint": ".checkpoint.files",
    "latest_checkpoint": ".checkpoint.files",
    "save_units": ".checkpoint.run_state", "load_units": ".checkpoint.run_state",
    "save_distributed": ".checkpoint.dcp", "restore_trainable": ".checkpoint.dcp", "restore_units": ".checkpoint.dcp",
    "sharded_unit_weights": ".checkpoint.dcp",
    "join_run": ".distributed.across_ranks", "plan_note": ".distributed.across_ranks",
    "WearMeter": ".wear",
    "FinetuneResult": ".runs", "RunInfo": ".runs", "describe_run": ".runs", "find_runs": ".runs",
    "push_to_hub": ".hub", "HubError": ".hub",
}
__all__ = list(sorted(_EXPORTS))


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
