"""outcore.optim: memory-lean optimizers on one contract (:class:`OutcoreOptimizer`).

Every optimizer here is a ``torch.optim.Optimizer`` usable in any PyTorch loop, with all
persistent state as tensors in ``self.state[p]`` and a per-block entry point
(``state_spec`` / ``init_state`` / ``update``) the out-of-core engine calls with state
streamed from its tiered store.

``MeZO`` and ``SparseMeZO`` (zeroth-order) are re-exported lazily from their modules; the
block schedule that streams a ZO run from NVMe is :mod:`outcore.offload.zo_engine`.
"""
from __future__ import annotations

import importlib
from typing import Any

from ._base import OutcoreOptimizer, StateSpec
from .adamw import AdamW
from .adamw8bit import AdamW8bit
from .apollo import APOLLO, APOLLOMini
from .frugal import FRUGAL
from .galore import GaLore

_LAZY = {"MeZO": ".mezo", "SparseMeZO": ".sparse_mezo", "ZOHyper": ".zo_core", "replay": ".zo_replay"}

# CLI / config names (``--optim``) of the gradient-based optimizers.
OPTIMIZERS = {"adamw": AdamW, "adamw8bit": AdamW8bit, "galore": GaLore, "apollo": APOLLO,
              "apollo-mini": APOLLOMini, "frugal": FRUGAL}

__all__ = ["OutcoreOptimizer", "StateSpec", "AdamW", "AdamW8bit", "GaLore", "APOLLO",
           "APOLLOMini", "FRUGAL", "MeZO", "SparseMeZO", "ZOHyper", "replay", "OPTIMIZERS",
           "build_optimizer"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # written by another module owner; imported on first use only
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_optimizer(name: str, params: Any, **kwargs: Any) -> OutcoreOptimizer:
    """An optimizer by its CLI name (``adamw``, ``adamw8bit``, ``galore``, ``apollo``,
    ``apollo-mini``, ``frugal``).

    Args:
        name: the ``--optim`` name.
        params: parameters or param-group dicts.
        **kwargs: hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay`` and the
            optimizer's own, e.g. ``rank``), typically ``FinetuneConfig`` fields plus
            ``optim_args``.

    Returns:
        The optimizer.

    Raises:
        ConfigError: unknown name or hyper-parameter, or a value out of range.
    """
    import inspect

    from ..errors import ConfigError

    if name not in OPTIMIZERS:
        raise ConfigError(f"optim={name!r} is not one of: {', '.join(OPTIMIZERS)} "
                          "(mezo / sparse-mezo are built by the zeroth-order recipe)")
    cls = OPTIMIZERS[name]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ConfigError(f"optim_args {unknown} are not hyper-parameters of {name!r}; "
                          f"it takes: {', '.join(sorted(accepted))}")
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        return cls(params, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"optim={name!r}: {exc}") from None
