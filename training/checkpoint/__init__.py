"""outcore.training.checkpoint — a run's checkpoints: on disk (``files.py``: the layout, the
atomic write, the digests that verify them, loading), what they hold of the run
(``run_state.py``: RNG states, trainable tensors, the units of a run out of core), and a
data-parallel run's state through ``torch.distributed.checkpoint`` (``dcp.py``).
"""
from ..._exports import lazy_exports

_EXPORTS = {
    "save_checkpoint": ".files", "load_checkpoint": ".files", "latest_checkpoint": ".files",
    "checkpoints": ".files", "verify_checkpoint": ".files", "load_newest_valid": ".files",
    "is_distributed": ".files",
    "rng_state": ".run_state", "set_rng_state": ".run_state", "trainable_state": ".run_state",
    "save_units": ".run_state", "load_units": ".run_state", "units_bytes": ".run_state",
    "save_distributed": ".dcp", "restore_trainable": ".dcp", "restore_units": ".dcp",
    "sharded_unit_weights": ".dcp",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
