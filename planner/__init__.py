"""outcore.planner — the memory plan: which tier holds what, how deep to prefetch, what a step costs.

:func:`make_plan` (or :func:`plan_for_config`, from a ``FinetuneConfig``) weighs every
offload layout and activation policy against the :class:`Budgets` (from the hardware
probe or explicit flags) and returns a :class:`MemoryPlan`; ``outcore plan`` prints it,
``outcore finetune`` follows it. It sits above ``offload`` and ``activations``: it sizes
what they will hold, and neither imports it.
"""
from .._exports import lazy_exports

_EXPORTS = {
    "MemoryPlan": ".plan", "UnitPlacement": ".plan", "make_plan": ".plan", "plan_for_config": ".plan",
    "Budgets": ".budget", "budgets_from_probe": ".budget",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
