"""outcore.training.distributed — a recipe run as one of the ranks ``torchrun`` (or
``accelerate launch``) started: joining them, each rank's share of the data, the gradients
summed, what rank 0 alone writes, a lost rank (``across_ranks.py``), and a torchrun restart
continuing its own run (``elastic.py``).
"""
from ..._exports import lazy_exports

_EXPORTS = {
    "SINGLE": ".across_ranks", "join_run": ".across_ranks", "leave_run": ".across_ranks",
    "plan_note": ".across_ranks", "rank_threads": ".across_ranks", "peer_guard": ".across_ranks",
    "my_micro_batches": ".across_ranks", "all_reduce_grads": ".across_ranks", "accumulate": ".across_ranks",
    "DataParallelAdapters": ".across_ranks", "data_parallel": ".across_ranks", "prepare_run_dir": ".across_ranks",
    "broadcast_from_main": ".across_ranks", "gather_rank_stats": ".across_ranks", "barrier": ".across_ranks",
    "check_stop": ".across_ranks", "with_ranks": ".across_ranks", "rank_swap_dir": ".across_ranks",
    "zo_split": ".across_ranks", "step_size": ".across_ranks", "restore_loader": ".across_ranks",
    "continue_after_restart": ".elastic", "mark_launch": ".elastic", "launch_id": ".elastic",
    "LAUNCH_MARKER": ".elastic",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
