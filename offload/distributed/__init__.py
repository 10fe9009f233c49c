"""outcore.offload.distributed — which rank this process is, and the collectives every rank calls.

:class:`Ranks` (from the launcher's environment, ``join``/``leave`` of the process group,
``elastic_attempt``) is the one definition of rank and world for every distributed part of
outcore; ``flat_collectives`` and ``global_norm`` move flat tensors between the ranks. It
knows nothing of units: the engine's sharded update builds on it.
"""
from ..._exports import lazy_exports

_EXPORTS = {
    "Ranks": ".ranks", "DEFAULT_TIMEOUT_S": ".ranks", "from_env": ".ranks", "join": ".ranks",
    "leave": ".ranks", "elastic_attempt": ".ranks",
    "flat_collectives": ".collectives", "global_norm": ".collectives",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
