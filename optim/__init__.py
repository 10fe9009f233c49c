"""outcore.optim: memory-lean optimizers on one contract (:class:`OutcoreOptimizer`).

Every optimizer here is a ``torch.optim.Optimizer`` usable in any PyTorch loop, with all
persistent state as tensors in ``self.state[p]`` and a per-block entry point
(``state_spec`` / ``init_state`` / ``update``) the out-of-core engine calls with state
streamed from its tiered store.

:data:`OPTIMIZERS` is the one list of optimizer names: the config, the command line and
the planner take theirs from it (the planner sizes each one's state from its own
``state_spec``). To add an optimizer, subclass :class:`OutcoreOptimizer` and name it there.
Every class is imported on first use, so naming an optimizer does not import torch.
The block schedule that streams a zeroth-order run (MeZO / Sparse MeZO) from NVMe is
:mod:`outcore.offload.zo.engine`; it gets the ZO math from ``ZOHyper.rule``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._exports import lazy_exports

if TYPE_CHECKING:
    from ._base import OutcoreOptimizer

#: ``--optim`` name -> ``"module:Class"`` (a module relative to this package, or absolute)
#: of the gradient-based optimizers, built by :func:`build_optimizer`.
OPTIMIZERS: dict[str, str] = {
    "adamw": ".adamw:AdamW", "adamw8bit": ".adamw8bit:AdamW8bit", "galore": ".galore:GaLore",
    "apollo": ".apollo:APOLLO", "apollo-mini": ".apollo:APOLLOMini", "frugal": ".frugal:FRUGAL",
}
#: ``--optim`` name -> ``"module:Class"`` of the zeroth-order optimizers (method ``zo``; built
#: by the zeroth-order recipe, they keep no state).
ZO_OPTIMIZERS: dict[str, str] = {"mezo": ".mezo:MeZO", "sparse-mezo": ".sparse_mezo:SparseMeZO"}

_LAZY = {"OutcoreOptimizer": "._base", "StateSpec": "._base",
         **{ref.split(":")[1]: ref.split(":")[0] for ref in (*OPTIMIZERS.values(), *ZO_OPTIMIZERS.values())},
         "ZOHyper": ".zo_core", "replay": ".zo_replay", "LeanOptimizer": ".lean", "with_precision": ".lean"}

__all__ = ["OutcoreOptimizer", "StateSpec", "AdamW", "AdamW8bit", "GaLore", "APOLLO",
           "APOLLOMini", "FRUGAL", "MeZO", "SparseMeZO", "ZOHyper", "replay", "OPTIMIZERS",
           "ZO_OPTIMIZERS", "optimizer_names", "optimizer_class", "build_optimizer", "LeanOptimizer",
           "with_precision"]


# imported on first use only (torch, and modules of other owners)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


def optimizer_names() -> tuple[str, ...]:
    """Every ``--optim`` name: the gradient-based ones, then the zeroth-order ones."""
    return (*OPTIMIZERS, *ZO_OPTIMIZERS)


def optimizer_class(name: str) -> type:
    """The class registered as ``name`` in :data:`OPTIMIZERS` (imported now).

    Raises:
        ConfigError: ``name`` is not a gradient-based optimizer.
    """
    from ..errors import ConfigError

    if name not in OPTIMIZERS:
        raise ConfigError(f"optim={name!r} is not one of: {', '.join(OPTIMIZERS)} "
                          f"({' / '.join(ZO_OPTIMIZERS)} are built by the zeroth-order recipe)")
    module, cls = OPTIMIZERS[name].split(":")
    return getattr(importlib.import_module(module, __name__), cls)


def build_optimizer(name: str, params: Any, **kwargs: Any) -> OutcoreOptimizer:
    """An optimizer by its ``--optim`` name (a key of :data:`OPTIMIZERS`).

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

    cls = optimizer_class(name)
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
