"""outcore.offload.zo — zeroth-order (MeZO) training by blocks, in memory or streamed from NVMe.

:class:`ZOBlockTrainer` visits a model's blocks (:class:`CausalLMBlocks`, the engine's units)
once per step with every perturbation sample's "+" and "-" forward, its weights held in RAM
or read through the store's unit memory. Distributed, ranks exchange seeds and losses, never
tensors (:func:`distributed_trainer`, :func:`make_exchange`).
"""
from ..._exports import lazy_exports

_EXPORTS = {
    "ZOBlockTrainer": ".engine", "Exchange": ".engine", "CausalLMBlocks": ".model", "StoreWeights": ".weights",
    "make_exchange": ".distributed", "distributed_trainer": ".distributed",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
