"""outcore.offload.engine — first-order training (and inference) with a model streamed through the store.

A model is cut into units (:class:`Unit`) whose buffers live in a :class:`StoreUnitMemory`;
the :class:`OutOfCoreEngine` binds each unit before it computes and runs its optimizer
update in the backward (sharded across :class:`~outcore.offload.distributed.Ranks`).
:func:`offload_model` assembles store, unit memory and engine for a model.
"""
from ..._exports import lazy_exports

_EXPORTS = {
    "OutOfCoreEngine": ".engine", "offload_model": ".assemble", "StreamedInference": ".inference",
    "Unit": ".units", "ParamSlot": ".units", "Part": ".units", "WEIGHTS": ".units", "GRADS": ".units",
    "causal_lm_units": ".units", "place_rest": ".units", "StoreUnitMemory": ".unit_memory",
    "step_in_memory": ".update", "save_sharded": ".sharded_checkpoint", "load_sharded": ".sharded_checkpoint",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
